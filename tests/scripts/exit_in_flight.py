"""End a process while a gloo all-reduce is still in flight, as a run's last collective can be.

usage: exit_in_flight.py PORT (exit_process | sys_exit)
The tensor's Python object is dropped at once, so gloo's worker thread holds the last reference
and must take the GIL to free it. With ``exit_process`` the process exits 3 with its buffered
output and atexit handlers intact; with ``sys.exit`` that thread may meet interpreter finalization.
Whether the interpreter finalized at all shows deterministically, where the abort shows in some runs
only: the line "finalized", written when CPython clears the interpreter (its audit event
``cpython.PyInterpreterState_Clear``, docs.python.org/3/library/audit_events.html).
"""
import atexit
import os
import sys

import torch
import torch.distributed as dist

from accel_ddp import exit_process


def _say_finalized(event: str, args, write=os.write) -> None:  # os.write held: finalization clears modules
    if event == "cpython.PyInterpreterState_Clear":
        write(1, b"finalized\n")


port, how = sys.argv[1], sys.argv[2]
sys.addaudithook(_say_finalized)
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
atexit.register(lambda: sys.stdout.write("atexit handler ran\n"))  # buffered: exit_process must flush it
sys.stdout.write("unflushed line\n")  # stdout is a pipe here, so this waits in the buffer
dist.all_reduce(torch.ones(1 << 24), async_op=True)  # 64 MB: still running as the script ends
if how == "exit_process":
    exit_process(3)
sys.exit(3)
