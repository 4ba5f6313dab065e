"""Tests of accel_ddp/cli/."""
