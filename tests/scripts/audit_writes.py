"""Run accel_ddp's CLI while logging every file this process opens for writing or renames.

usage: audit_writes.py LOG_PREFIX -- TRAIN ARGS...
Each rank appends `op<TAB>path` lines to LOG_PREFIX_rank<RANK>.log.
"""
import os
import sys

log_prefix, _, train_args = sys.argv[1], sys.argv[2], sys.argv[3:]
log = open(f"{log_prefix}_rank{os.environ.get('RANK', '0')}.log", "w", buffering=1)


def audit(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str) and args[1] and any(m in args[1] for m in "wax+"):
        log.write(f"open\t{os.path.abspath(args[0])}\n")
    elif event in ("os.rename", "os.replace"):
        log.write(f"rename\t{os.path.abspath(args[1])}\n")


sys.addaudithook(audit)
from accel_ddp.train import run  # noqa: E402

run(train_args)
