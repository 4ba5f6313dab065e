"""accel_ddp.outputs.names."""
