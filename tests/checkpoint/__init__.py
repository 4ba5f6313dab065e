"""Tests of accel_ddp/checkpoint/."""
