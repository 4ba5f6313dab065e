"""accel_ddp.distributed."""
