"""``--on_anomaly skip|rollback`` and ``--spike_factor`` (``AnomalyGuard``): the per-step decision whether a step's
update is left out, the host's view of it (a line and a record per anomaly; stop, go on or roll back), and the log of
those decisions, ``OUTPUT_DIR/anomalies.json``, which a resumed run follows."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from accel_ddp.bad_steps.stops import AnomalyStop, BadStepOptions, RolledBack
from accel_ddp.outputs.names import ANOMALIES_NAME
from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.messages import say
from accel_ddp.util.validation import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from accel_ddp.tracking.recorder import RunRecorder


class AnomalyGuard:
    """The per-step skip decision, the host's view of it, and ``anomalies.json`` (one per run, built by ``setup``).

    Its log (the steps left out, the rollbacks) is part of the run's training state (checkpoint/train_state.py): each
    checkpoint holds it as it was at the save step. ``anomalies.json`` holds it as it is now, decisions made after
    the last checkpoint included (a rollback's, which a resumed run must leave out again): a resume takes that file
    where it exists, else the checkpoint's copy.

        >>> guard = AnomalyGuard(options, accelerator, recorder)     # options: BadStepOptions
        >>> guard.begin(start_step)            # once the start is agreed (a resume restored the log before)
        >>> bad = guard.decide(grad_norm)      # in the update, once per optimizer step: a device bool
        >>> guard.resolve(step, last_saved)    # where the loop syncs: lines, records, rollback or stop
    """

    def __init__(self, options: BadStepOptions, accelerator: Accelerator, recorder: RunRecorder):
        if accelerator.scaler is not None and options.on_anomaly != "stop":
            raise ConfigError(f"--on_anomaly {options.on_anomaly} with --mixed_precision fp16 is not supported (its "
                              "loss scaler skips steps by itself); use --mixed_precision bf16 or --on_anomaly stop")
        self.mode, self.spike_factor, self.spike_window = options.on_anomaly, options.spike_factor, options.spike_window
        self.skips = self.mode != "stop"  # stop with --spike_factor: only the log lines' spike check
        self.max_anomalies = options.max_anomalies
        self.accelerator, self.main = accelerator, accelerator.is_main_process
        self.path = os.path.join(options.output_dir, ANOMALIES_NAME)
        self.recorder = recorder
        self.known: dict[str, Any] = {"skipped": {}, "rollbacks": []}
        self.restored: dict[str, Any] | None = None  # the log of the checkpoint resumed from, if it holds one
        self.device = accelerator.device
        self.history: list[tuple[int, float]] = []  # (step, logged loss) of the last --spike_window log lines
        self.in_a_row, self.last_bad = 0, None
        self.input_was_bad = False  # the next micro-batch's input held a nan or inf (host: the loader knows)
        self.bad_inputs: dict[int, list[str]] = {}  # step -> this rank's bad samples in it, until resolved
        self.restart(0)

    def state_dict(self) -> dict[str, Any]:
        """The log at this step, for the checkpoint (train_state.py)."""
        return json.loads(json.dumps(self.known))  # a copy: the log grows while an async save is written

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The checkpoint's copy of the log, used by :meth:`begin` on a resume. A rollback keeps the log in memory,
        which holds the checkpoint's and every decision since."""
        usable = isinstance(state, dict) and isinstance(state.get("skipped"), dict) and \
            isinstance(state.get("rollbacks"), list)
        self.restored = state if usable else None

    def begin(self, start_step: int) -> None:
        """Once the start is agreed: a resumed run continues the log (``anomalies.json``, else the checkpoint's); a
        fresh start forgets an earlier run's choices."""
        if start_step:
            self.known = read_anomalies(self.path, self.restored)
        elif self.main and os.path.exists(self.path):
            os.remove(self.path)
        self.restart(start_step)

    def restart(self, step: int) -> None:
        """At the start of ``fit``, also after a rollback: steps counted from ``step``, nothing pending."""
        self.step = step  # the optimizer step decide() is called for, minus 1
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, bad, norm) not yet read
        self.last_bad_flag = torch.zeros((), dtype=torch.bool, device=self.device)
        self.skipped_since_log = 0
        self.logged_at = step  # the last log line's step: a spike's window starts after it
        self.history = [(s, loss) for s, loss in self.history if s <= step]  # a rollback forgets the replayed

    def poisoned(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, times nan where it is not finite, or where its micro-batch held a nan or inf input (the loader
        said so: :meth:`bad_input`): its rank's gradients turn nan, and DDP's all-reduce spreads that to every rank,
        so the step is skipped everywhere (an inf loss can have finite gradients, a masked nan input a finite loss)."""
        if self.input_was_bad:
            self.input_was_bad = False
            return loss * math.nan
        return loss * torch.where(torch.isfinite(loss.detach()), 1.0, math.nan).to(loss.dtype)

    def bad_input(self, what: str) -> None:
        """The loader's report (``loader.report_bad_inputs``): the micro-batch it serves next holds a nan or inf input,
        ``what`` names the sample. Its step is left out like any anomaly, and its record names the sample."""
        self.input_was_bad = True
        self.bad_inputs.setdefault(self.step + 1, []).append(what)  # decide() counts this step when it completes

    def decide(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """Once per optimizer step, with the all-reduced gradient norm: a device bool, True = do not update."""
        self.step += 1
        bad = ~torch.isfinite(grad_norm.detach())
        if str(self.step) in self.known["skipped"]:  # a recorded choice (rollback, resume): a host fact, no sync
            bad = torch.ones((), dtype=torch.bool, device=self.device)
        self.pending.append((self.step, bad, grad_norm.detach()))
        self.last_bad_flag = bad
        return bad

    def resolve(self, step: int, last_saved: tuple[int, str] | None) -> int:
        """Read the pending decisions (one D2H copy, where the loop syncs anyway): a line and a record per new
        anomaly; stop after --max_anomalies in a row; under rollback raise ``RolledBack``. Returns how many of the
        steps since the last log line were skipped (they are left out of the logged loss)."""
        if not self.pending:
            return self.skipped_since_log
        flags = torch.stack([torch.stack([bad.double(), norm.double()]) for _, bad, norm in self.pending]).tolist()
        steps = [s for s, _, _ in self.pending]
        self.pending = []
        new = []
        for s, (bad, norm) in zip(steps, flags, strict=True):
            if not bad:
                continue
            self.skipped_since_log += 1
            if str(s) in self.known["skipped"]:  # replayed: recorded when it was found
                action = "rollback" if any(s in back["steps"] for back in self.known["rollbacks"]) else "skip"
                self.log({"step": s, "anomaly": self.known["skipped"][str(s)], "action": action, "replayed": True,
                          **({"detail": d} if (d := self.known.get("inputs", {}).get(str(s))) else {})})
            else:
                new.append((s, f"gradient norm {norm}"))
        if new:
            self._found(self._inputs_named(new), "non_finite", last_saved)
        self.bad_inputs = {s: what for s, what in self.bad_inputs.items() if s > steps[-1]}  # replayed: recorded
        return self.skipped_since_log

    def _inputs_named(self, new: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """The new anomalies, each with the samples whose nan/inf input made it where a rank's loader found one: only
        that rank knows, so every rank sends its own (a collective, only where the ranks agree on a new anomaly)."""
        from accelerate.utils import gather_object

        mine = {s: self.bad_inputs.pop(s) for s, _ in new if s in self.bad_inputs}
        found: dict[int, list[str]] = {}
        for rank_found in gather_object([mine]):
            for s, what in rank_found.items():
                found.setdefault(s, []).extend(what)
        for s, what in found.items():  # anomalies.json: a rollback's replay, or a resume, names them again
            self.known.setdefault("inputs", {})[str(s)] = "; ".join(what)
        return [(s, "; ".join(found[s]) if s in found else what) for s, what in new]

    def after_log(self, step: int, mean_loss: float, last_saved: tuple[int, str] | None) -> None:
        """At a log line, with the logged (all-reduced) loss: the spike check, then the loss joins the median."""
        since, self.logged_at = self.logged_at, step
        self.skipped_since_log = 0
        if not math.isfinite(mean_loss):
            return
        if self.spike_factor and len(self.history) >= self.spike_window:
            median = statistics.median(loss for _, loss in self.history[-self.spike_window:])
            if mean_loss > self.spike_factor * median:
                window = [s for s in range(since + 1, step + 1) if str(s) not in self.known["skipped"]]
                what = f"loss {mean_loss:.6g} > {self.spike_factor:g} x median {median:.6g}"
                self._found([(s, what) for s in window], "spike", last_saved)
                return
        self.history = [*self.history, (step, mean_loss)][-self.spike_window:]

    def _found(self, found: list[tuple[int, str]], kind: str, last_saved: tuple[int, str] | None) -> None:
        """New anomalies at ``found`` steps (identical on every rank): count, record, then go on, roll back or stop."""
        first = found[0][0]
        # In a row: anomalous steps with no trained step between them; a spike's window counts once.
        for s in [first] if kind == "spike" else [s for s, _ in found]:
            self.in_a_row = self.in_a_row + 1 if self.last_bad == s - 1 else 1
            self.last_bad = s
        self.last_bad = found[-1][0]
        action = "skip" if self.mode == "skip" and kind != "spike" else self.mode
        if action == "rollback" and (last_saved is None or last_saved[0] >= first):
            action = "stop"  # nothing to go back to: the weights after the bad step are all there is
        if self.in_a_row >= self.max_anomalies:
            action = "stop"
        for s, what in found:
            self.known["skipped"][str(s)] = kind
            self.log({"step": s, "anomaly": kind, "action": action, "detail": what})
        steps = _span([s for s, _ in found])
        checkpoint = last_saved[1] if last_saved else None
        if action == "stop":
            why = (f"{self.in_a_row} anomalies in a row (--max_anomalies {self.max_anomalies})"
                   if self.in_a_row >= self.max_anomalies else "no checkpoint from before it to roll back to"
                   if self.mode == "rollback" else "--on_anomaly stop")
            raise AnomalyStop(f"{kind.replace('_', '-')} step {steps} ({found[0][1]}): {why}", first, checkpoint)
        if action == "rollback":
            self.known["rollbacks"].append({"steps": [s for s, _ in found], "kind": kind, "to_step": last_saved[0]})
        self._write()
        done = (f"rolled every rank back to {checkpoint}, leaving out step {steps}" if action == "rollback"
                else "skipped its update on every rank")
        say(f"anomaly: {kind.replace('_', '-')} at optimizer step {steps} ({found[0][1]}); {done} ({self.in_a_row} in "
            f"a row, at most --max_anomalies {self.max_anomalies})", ranks="main")
        if action == "rollback":
            raise RolledBack(checkpoint, last_saved[0])

    def log(self, record: dict[str, Any]) -> None:
        self.recorder.log(record)  # main process only (the recorder's rule)

    def _write(self) -> None:
        if self.main:
            atomic_write_text(self.path, json.dumps(self.known, indent=2, sort_keys=True) + "\n")

    def summary(self) -> dict[str, int]:
        """summary.json's counts: steps trained without their update, and rollbacks, over the whole run."""
        return {"anomaly_skipped_steps": len(self.known["skipped"]), "anomaly_rollbacks": len(self.known["rollbacks"])}


def read_anomalies(path: str, saved: dict[str, Any] | None = None) -> dict[str, Any]:
    """``anomalies.json`` of a resumed run (``saved``, the checkpoint's copy, or an empty log when absent); a damaged
    one is bad input (exit 2)."""
    if not os.path.exists(path):
        return saved if saved is not None else {"skipped": {}, "rollbacks": []}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data.get("skipped"), dict) or not isinstance(data.get("rollbacks"), list):
            raise ValueError("expected 'skipped' and 'rollbacks'")
        return data
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{path} is damaged ({err}); restore it, or delete it to forget the recorded skips") from err


def _span(steps: Iterable[int]) -> str:
    """``5``, ``5-7`` (consecutive) or ``5, 7``."""
    steps = list(steps)
    if len(steps) == 1:
        return str(steps[0])
    return f"{steps[0]}-{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) else ", ".join(map(str, steps))
