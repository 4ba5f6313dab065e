"""A script that builds Accelerate's state without asking for CPU before calling accel_ddp: on a machine
without GPUs the ranks then do not form one group, and accel_ddp must refuse to train."""
import sys

from accelerate import PartialState

PartialState()  # no cpu=True: each torchrun process becomes a lone world of 1

from accel_ddp.loop import run  # noqa: E402

run(sys.argv[1:])
