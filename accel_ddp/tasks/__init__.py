"""accel_ddp.tasks.protocol."""
