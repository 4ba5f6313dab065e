"""Rank 1 sleeps past --ddp_timeout before a barrier: rank 0 must fail with a timeout, not wait.

usage: timeout_probe.py [train.py flags...]
"""
import sys
import time

from accel_ddp import exit_process
from accel_ddp.config import parse_args
from accel_ddp.loop import build_accelerator

accelerator, _, _ = build_accelerator(parse_args(sys.argv[1:]))
if accelerator.process_index == 1:
    time.sleep(60)
accelerator.wait_for_everyone()
print("barrier passed", flush=True)
exit_process(0)
