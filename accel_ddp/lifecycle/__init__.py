"""accel_ddp.lifecycle."""
