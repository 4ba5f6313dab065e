"""Lets `accelerate launch ... train.py` work from a clone; the code lives in accel_ddp/loop.py."""
from accel_ddp.loop import run

if __name__ == "__main__":
    run()
