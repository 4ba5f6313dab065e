"""``accel-ddp doctor``: check an accelerate config file against this machine before launching.

    accel-ddp doctor                      # the file `accelerate launch` reads without --config_file
    accel-ddp doctor --config_file accelerate_configs/4gpu.yaml
    python -m accel_ddp doctor --config_file accelerate_configs/2node_8gpu.yaml --machine_rank 1

Without ``--config_file`` the doctor checks the file ``accelerate launch`` would read, found as
Accelerate finds it (the default config that ``accelerate config`` writes, under ``HF_HOME``), and
says so when there is none (``accelerate launch`` then uses its defaults: one process per GPU, or
one process without GPUs). The file is read with Accelerate's own loader (``launch_config.py``), launch flags given here
override it the way they override it on the ``accelerate launch`` line, and each finding is one
line, ``problem -> fix``. Then comes the exact launch command (one per machine). The report
starts with the file checked, the machine and the versions that matter (``machine.py``), so one paste
answers "what are you running". The checks are in ``doctor_checks.py``, the report in ``doctor_report.py``.

Levels: ``error`` (the launch fails, or silently runs something other than the file says: one
process instead of N, fp32 instead of fp16, DDP instead of FSDP), ``warning`` (it runs as
written but probably not as meant), ``note`` (worth knowing; nothing to fix). Exit code 0 when
there is no error, 1 otherwise, 2 when the file cannot be read at all.

A machine without GPUs is a valid target: ``distributed_type: MULTI_GPU`` there makes torchrun
start the processes and accel_ddp asks Accelerate for CPU, so they form a gloo group (this is
``cpu_2proc.yaml``). That is a note, unless the file plainly wants GPUs (a list of ``gpu_ids``
for several processes, fp16, FSDP), which is an error.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import sys
from typing import Any

from accel_ddp.cli.doctor_checks import no_config_file, read_launch, run_checks
from accel_ddp.cli.doctor_report import ERROR, NOTE, WARNING, Finding, Report
from accel_ddp.cli.launch_config import DoctorInputError, launch_defaults, load_launch_config, resolve_config_file
from accel_ddp.cli.machine import MachineFacts, software_versions
from accel_ddp.lifecycle.exit_codes import ExitCode
from accel_ddp.util.messages import write

__all__ = ["ERROR", "NOTE", "WARNING", "Finding", "Report", "build_parser", "diagnose", "main", "port_in_use", "run"]

# Launch flags the doctor understands, with the type ``accelerate launch`` gives them.
OVERRIDES: dict[str, type] = {
    "num_processes": int, "num_machines": int, "machine_rank": int, "main_process_ip": str,
    "main_process_port": int, "gpu_ids": str, "mixed_precision": str,
}


def diagnose(config_file: str | None, facts: MachineFacts | None = None, overrides: dict[str, Any] | None = None,
             cpu: bool = False, script: str = "train.py", is_port_in_use=None) -> Report:
    """Check ``config_file`` (plus ``accelerate launch`` flag ``overrides``) against ``facts``.

    ``config_file=None``: the file ``accelerate launch`` would read without ``--config_file``.

        >>> report = diagnose("accelerate_configs/4gpu.yaml", MachineFacts(gpu_count=4, nccl_available=True))
        >>> report.ok, [f.line() for f in report.findings]
    """
    facts = facts or MachineFacts.detect()
    is_port_in_use = is_port_in_use or port_in_use
    source = resolve_config_file(config_file, cpu)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if source.path is None:
        config = {**launch_defaults(facts), **overrides}
    else:
        config = {**load_launch_config(source.path, "--config_file" if source.flag else "default config"),
                  **overrides}
    report = Report(source, facts)
    if source.path is None:
        no_config_file(report, facts, cpu)
    launch = read_launch(report, config, cpu)
    report.summary = (f"{launch.dist}, {launch.num_processes} process(es) in total on {launch.num_machines} "
                      f"machine(s) (this is machine {launch.machine_rank}), mixed precision {launch.mixed}")
    run_checks(report, config, facts, launch, cpu, is_port_in_use)

    # The command to run: the file plus the flags given here, less a --cpu flagged above.
    report.commands = _launch_commands(source.path if source.flag else None, overrides, launch.num_machines, script,
                                       cpu and launch.num_processes <= 1)
    if launch.num_machines > 1 and launch.launcher_starts_many:
        report.footnotes.append(
            f"the {launch.num_machines} machines need --output_dir on a file system they all mount at the same path "
            "(NFS, Lustre, ...): the main process seals each checkpoint from the files every rank wrote, and every "
            "rank reads it back on resume; accel_ddp checks this at start and refuses a folder that is not shared")
    return report


def port_in_use(port: int) -> bool:
    """Accelerate's own test (``accelerate.utils.is_port_in_use``): something accepts connections there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _launch_commands(config_file: str | None, overrides: dict[str, Any], num_machines: int, script: str,
                     cpu: bool) -> list[str]:
    base = ["accelerate", "launch", *(["--config_file", config_file] if config_file else [])]
    for key, value in overrides.items():
        if key != "machine_rank" and value is not None:
            base += [f"--{key}", str(value)]
    if cpu:
        base.append("--cpu")
    if num_machines <= 1:
        return [shlex.join([*base, script])]
    return [shlex.join([*base, "--machine_rank", str(rank), script]) + f"   # on machine {rank}"
            for rank in range(num_machines)]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="accel-ddp doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--config_file", default=None,
                        help="the accelerate config to check (default: the one `accelerate launch` would read)")
    parser.add_argument("--script", default="train.py", help="training script for the printed launch command")
    parser.add_argument("--cpu", action="store_true", help="check `accelerate launch --cpu` (a trap: 1 process)")
    for name, kind in OVERRIDES.items():
        parser.add_argument(f"--{name}", type=kind, default=None, help="as on the `accelerate launch` line")
    return parser


def run(args: argparse.Namespace, facts: MachineFacts | None = None) -> int:
    overrides = {name: getattr(args, name) for name in OVERRIDES}
    try:
        report = diagnose(args.config_file, facts, overrides, cpu=args.cpu, script=args.script)
    except DoctorInputError as err:
        write(f"accel-ddp doctor: error: {err}", err=True)
        return ExitCode.BAD_INPUT
    report.versions = software_versions()
    write(report.render())
    return ExitCode.OK if report.ok else ExitCode.FAILED


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
