"""accel_ddp.tracking.recorder."""
