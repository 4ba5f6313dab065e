"""accel_ddp.util."""
