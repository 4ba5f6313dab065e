"""``accel-ddp``: training and the commands around it.

    accel-ddp launch [ACCELERATE LAUNCH ARGS] train.py [FLAGS]   `accelerate launch`, ending with the failing
                                          rank's own line and exit code (no launcher traceback)
    accelerate launch --config_file FILE -m accel_ddp train [FLAGS]   train (what train.py runs)
    accel-ddp doctor [--config_file FILE] check a launch config (default: the one `accelerate launch` reads)
                                          against this machine; print the versions and the launch command
    accel-ddp plot OUTPUT_DIR             write OUTPUT_DIR/curves.png from metrics.jsonl
    accel-ddp summary OUTPUT_DIR          print a finished run's summary as a table
    accel-ddp evaluate RUN [--out FILE]   a trained run's (or checkpoint's) eval metrics again, on every rank
    accel-ddp predict RUN --out FILE      its prediction for each eval sample, JSON Lines in the eval set's order

Also ``python -m accel_ddp COMMAND ...``. Heavy imports (torch, accelerate, matplotlib) happen
inside each command so that ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import sys

from accel_ddp.lifecycle.exit_codes import ExitCode
from accel_ddp.util.messages import write


def _summary(args: argparse.Namespace) -> int:
    from accel_ddp.tracking.report import format_summary

    try:
        write(format_summary(args.output_dir))
    except FileNotFoundError as err:
        write(f"accel-ddp: error: {err}", err=True)
        return ExitCode.BAD_INPUT
    return ExitCode.OK


def _plot(args: argparse.Namespace) -> int:
    from accel_ddp.tracking.curves import plot_run

    try:
        path = plot_run(args.output_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        write(f"accel-ddp: error: {err}", err=True)
        return ExitCode.BAD_INPUT
    write(path)
    return ExitCode.OK


def _doctor(args: argparse.Namespace) -> int:
    from accel_ddp.cli import doctor

    return doctor.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accel-ddp", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("launch", help="accelerate launch's arguments: launch, then exit with the failing rank's "
                        "code, its own line shown without the launcher's traceback; see launch --help", add_help=False)
    commands.add_parser("train", help="train (under `accelerate launch ... -m accel_ddp train`); see train --help",
                        add_help=False)

    doctor = commands.add_parser(
        "doctor", help="check an accelerate config file against this machine (exit 0 ready, 1 not, 2 unreadable)",
        description="Check an accelerate config file against this machine: the one given with --config_file, "
                    "else the one `accelerate launch` reads without it (Accelerate's default config, written by "
                    "`accelerate config`). Launch flags given here override the file as they do on the "
                    "`accelerate launch` line.")
    from accel_ddp.cli.doctor import build_parser as build_doctor_parser

    build_doctor_parser(doctor)
    doctor.set_defaults(func=_doctor)

    plot = commands.add_parser(
        "plot", help="write curves.png (losses, the task's metric, LR, samples/s against step; epochs marked)")
    plot.add_argument("output_dir")
    plot.add_argument("--out", default=None, help="where to write the PNG (default: OUTPUT_DIR/curves.png)")
    plot.set_defaults(func=_plot)

    summary = commands.add_parser("summary", help="print a run's summary.json as a table")
    summary.add_argument("output_dir")
    summary.set_defaults(func=_summary)

    from accel_ddp.cli.inference import add_commands as add_inference_commands

    add_inference_commands(commands)  # evaluate, predict
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # the training flags are TrainConfig's own parser's business
        from accel_ddp.cli.train import run

        run(argv[1:])
    if argv[:1] == ["launch"]:  # accelerate launch's arguments: its own parser's business
        from accel_ddp.cli import launch

        return launch.run(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
