"""Tests of accel_ddp/data/."""
