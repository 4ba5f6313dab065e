"""accel_ddp.checkpoint.manager."""
