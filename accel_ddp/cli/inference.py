"""``accel-ddp evaluate`` and ``accel-ddp predict``: a trained run's evaluation again, and its predictions per sample.

    accel-ddp evaluate outputs/run [--out eval.json]                 # prints the metrics as JSON
    accel-ddp predict outputs/run/checkpoints/step_00000040 --out predictions.jsonl
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml -m accel_ddp evaluate outputs/run

A path that holds no finished run or checkpoint is refused before torch is imported (one line, exit 2); the rest is
``accel_ddp.inference`` on every rank of the launch, its failures reported once per launch as training's are.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from accel_ddp.lifecycle import failure, refusal
from accel_ddp.lifecycle.exit_codes import ExitCode
from accel_ddp.outputs.trained import find_trained
from accel_ddp.util.messages import say, write
from accel_ddp.util.ranks import is_first_rank
from accel_ddp.util.validation import ConfigError

RUN_HELP = "a finished run's --output_dir (its final model.safetensors), or one of its checkpoints/step_* folders"
DATA_DIR_HELP = "where the run's data is now, if it moved since training (default: the run's --data_dir)"


COMMANDS = {  # name: (help, description, --out's help, --out required)
    "evaluate": ("evaluate a trained run (or a checkpoint) on its eval set, on every rank of the launch",
                 "Rebuild a run from its config.yaml, load its final weights (or a checkpoint's, proven whole first) "
                 "and evaluate them on the run's eval set, each sample once on any number of processes. Prints the "
                 "metrics (summary.json's keys) as JSON.",
                 "also write the metrics there, as JSON", False),
    "predict": ("write a trained run's prediction for each eval sample (JSON Lines, in the eval set's order)",
                "Rebuild a run as evaluate does and write one JSON row per eval sample, in the eval set's order, the "
                "same file on any number of processes: {\"index\", \"prediction\", \"label\"} (a class id; for "
                "causal_lm, the next-token ids of each position that has one).",
                "where to write the rows (FILE.jsonl)", True),
}


def add_commands(commands) -> None:
    """The ``evaluate`` and ``predict`` subcommands of ``accel-ddp`` (``commands``: its subparsers)."""
    for name, (short, description, out_help, out_required) in COMMANDS.items():
        command = commands.add_parser(name, help=short, description=description)
        command.add_argument("run", metavar="RUN_OR_CHECKPOINT", help=RUN_HELP)
        command.add_argument("--out", default=None, required=out_required, help=out_help)
        command.add_argument("--data_dir", default=None, help=DATA_DIR_HELP)
        command.set_defaults(func=run)


def main(args: argparse.Namespace) -> int:
    """The command on this rank: its exit code (2: bad input, one line per launch; 1: anything else, its traceback)."""
    try:
        trained = find_trained(args.run, args.data_dir)
    except ConfigError as err:  # before torch: every rank alike, rank 0 says it
        return refusal.refuse_options(err)
    try:
        if args.command == "evaluate":
            from accel_ddp.inference import evaluate

            result = evaluate(trained, args.out)
            if is_first_rank():
                write(json.dumps(result, indent=2))
        else:
            from accel_ddp.inference import predict

            rows = predict(trained, args.out)
            say(f"wrote {rows} predictions to {args.out}", ranks="first")
    except Exception as err:  # noqa: BLE001 - every failure gets its exit code and, once per launch, its report
        return failure.report(err, failure.exit_code(err))
    return ExitCode.OK


def run(args: argparse.Namespace) -> NoReturn:
    """``main``, then exit; through ``exit_process`` once torch is loaded (gloo's threads cannot race the
    interpreter's teardown: accel_ddp/lifecycle/preemption.py)."""
    code = main(args)
    if "torch" not in sys.modules:
        sys.stdout.flush()
        sys.exit(code)
    from accel_ddp.lifecycle.preemption import exit_process

    exit_process(code)
