"""Tests of accel_ddp/distributed/."""
