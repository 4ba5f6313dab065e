"""Lets `accelerate launch ... train.py` work from a clone; the code lives in accel_ddp/train.py."""
import sys

from accel_ddp.train import main

if __name__ == "__main__":
    sys.exit(main())
