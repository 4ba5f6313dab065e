"""Tests of accel_ddp/tracking/."""
