"""The training command: ``python train.py``, ``accel-ddp train``, ``accelerate launch train.py``.

``main()`` parses the options and trains, and turns every outcome into an exit code (a failure is
reported once per launch: :mod:`accel_ddp.lifecycle.failure`); ``run()`` exits with it.
"""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

from accel_ddp.cli.args import parse_args
from accel_ddp.lifecycle import failure, refusal
from accel_ddp.lifecycle.exit_codes import ExitCode, record
from accel_ddp.util.messages import warn
from accel_ddp.util.validation import ConfigError


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: returns the exit code. Bad flags and a bad recipe are refused here, before torch is
    imported (one line, exit 2, within a second of the start: ``refusal.refuse_options``); then ``train_main``."""
    try:
        cfg = parse_args(argv)
    except ConfigError as err:
        return refusal.refuse_options(err)
    except Exception as err:  # noqa: BLE001 - a bug in the parsing: its report, as below
        return failure.report(err, failure.exit_code(err))
    return train_main(cfg)


def train_main(cfg) -> int:
    """Train on good options: the exit code; a failure is reported once per launch (``accel_ddp.lifecycle.failure``).

    Bad input is one line on stderr and exit code 2, a nan/inf loss one line and 3, anything else
    its traceback and 1; a rank stopped by another rank's failure prints nothing and exits with that
    rank's code. Preemption (SIGTERM or SIGUSR1) saves a checkpoint and exits with ``ExitCode.PREEMPTED``
    (75), Ctrl-C (SIGINT) and a closed terminal (SIGHUP) likewise with 130 and 129; the exit codes are listed
    in ``accel_ddp/lifecycle/exit_codes.py``.
    """
    # torch, Accelerate and the loop: imported once the options are good
    from accel_ddp.lifecycle.preemption import Preempted, ignore_preemption_signals
    from accel_ddp.tracking.console_log import ConsoleLog

    console = ConsoleLog().install()  # run.log: everything rank 0 prints, the last line below included
    try:
        _train(cfg, console)
    except Preempted as stop:
        ignore_preemption_signals()  # exiting with 75: the launcher's follow-up SIGTERM must not make it a kill
        code = stop.exit_code
        what = "preempted" if code == ExitCode.PREEMPTED else "interrupted"
        warn(f"{stop} (exit code {code})", kind=what, ranks="first")
        return code
    except Exception as err:  # noqa: BLE001 - every failure gets its exit code and, once per launch, its report
        return failure.report(err, failure.exit_code(err))
    finally:
        console.close()
    return ExitCode.OK


def _train(cfg, console) -> None:
    """``train(cfg)``, with the preemption handlers installed as soon as torch is imported (a signal from then on is
    recorded, not fatal; before, it ends the process as usual, as nothing is there to save)."""
    from accel_ddp.lifecycle.preemption import PreemptionWatcher
    from accel_ddp.loop import train

    train(cfg, preemption=PreemptionWatcher().install(), console=console)


def run(argv: list[str] | None = None) -> NoReturn:
    """The script entry point (``python train.py``, ``accel-ddp train``): ``main()``, then exit.

    The exit goes through ``exit_process`` so that a successful run cannot abort during interpreter
    teardown.
    """
    try:
        code = main(argv)
    except Exception:  # noqa: BLE001 - the report itself failed: Python's traceback, then the same safe exit
        traceback.print_exc()
        code = ExitCode.FAILED
    record(code)  # for accel-ddp launch, which exits with it (a signalled launcher's own code says less)
    if "torch" not in sys.modules:  # refused before torch: no thread of gloo's to race the interpreter's exit
        sys.stdout.flush()
        sys.exit(code)
    from accel_ddp.lifecycle.preemption import exit_process

    exit_process(code)

