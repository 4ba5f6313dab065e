"""Tests of accel_ddp/lifecycle/."""
