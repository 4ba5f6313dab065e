"""accel_ddp.cli.commands."""
