"""Tests of accel_ddp/outputs/."""
