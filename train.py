"""Lets `accelerate launch ... train.py` work from a clone; the command lives in accel_ddp/cli/train.py."""
from accel_ddp.cli.train import run

if __name__ == "__main__":
    run()
