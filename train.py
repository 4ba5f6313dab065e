"""Lets `accelerate launch ... train.py` work from a clone; the code lives in accel_ddp/train.py."""
from accel_ddp.train import run

if __name__ == "__main__":
    run()
