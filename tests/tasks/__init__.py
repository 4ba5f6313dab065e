"""Tests of accel_ddp/tasks/."""
