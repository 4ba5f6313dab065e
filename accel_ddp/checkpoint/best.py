"""The best model and early stopping, with the Hugging Face Trainer's names and rules.

``--metric_for_best_model NAME`` (``eval_`` prepended when missing, as the Trainer does) picks the
evaluation metric; ``--greater_is_better`` defaults per metric: names ending in ``loss`` and
``perplexity`` are lower-is-better, every other metric higher-is-better (the Trainer's rule
``not name.endswith("loss")``, transformers/training_args.py, except that our ``eval_perplexity`` is
lower-is-better too).

Two records, updated after each evaluation from its gathered metrics, which are the same on every
rank: every rank takes the same decision at the same step without an extra collective.

- Early stopping (transformers ``EarlyStoppingCallback``, trainer_callback.py): the value is compared
  with the best before this evaluation; the counter restarts when it is strictly better *and* differs
  by more than ``--early_stopping_threshold`` (absolute), else grows by one; at
  ``--early_stopping_patience`` the run stops. A NaN metric never improves.
- The best model: the strictly best value among the evaluations whose weights are kept, i.e. those at a
  checkpoint step and the run's last step. Its checkpoint is kept besides ``--keep_last`` (the Trainer
  counts it inside ``save_total_limit``), and ``--load_best_model_at_end`` exports its weights.

Both records travel in ``checkpoint.json`` (``best`` key), so a resume continues them.

    >>> best = BestModel.from_options(section_of(cfg, BestModelOptions), steps_per_epoch=8, total_steps=32)
    >>> best.after_eval({"eval_loss": 0.3}, step=8)    # True: stop now (every rank)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accel_ddp.config.views import config_section
from accel_ddp.util.messages import say
from accel_ddp.util.validation import ConfigError

LOWER_IS_BETTER_SUFFIXES = ("loss", "perplexity")


def metric_key(name: str) -> str:
    """The metric's key in the evaluation's results: ``accuracy`` -> ``eval_accuracy`` (the Trainer's rule)."""
    return name if name.startswith("eval_") else f"eval_{name}"


def greater_is_better_default(name: str) -> bool:
    return not name.endswith(LOWER_IS_BETTER_SUFFIXES)


@config_section
@dataclass(frozen=True)
class BestModelOptions:
    """The options of the best model and early stopping (``dataset``: named where there is no eval set)."""

    metric_for_best_model: str | None
    greater_is_better: bool | None
    early_stopping_patience: int | None
    early_stopping_threshold: float
    load_best_model_at_end: bool
    checkpointing_steps: str | None  # which evaluations' weights are kept
    dataset: str


class BestModel:
    """Tracks the best evaluation (for the kept checkpoint and the exported weights) and the patience counter."""

    def __init__(self, metric: str, greater_is_better: bool | None, patience: int | None, threshold: float,
                 save_steps: int | str | None, steps_per_epoch: int, total_steps: int, load_at_end: bool):
        self.metric = metric_key(metric)
        self.greater = greater_is_better_default(self.metric) if greater_is_better is None else greater_is_better
        self.patience, self.threshold, self.load_at_end = patience, threshold, load_at_end
        self._save_steps, self._steps_per_epoch, self._total_steps = save_steps, steps_per_epoch, total_steps
        self.best_metric: float | None = None  # over every evaluation: early stopping's reference
        self.counter = 0  # evaluations in a row without an improvement above the threshold
        self.kept_metric: float | None = None  # over the evaluations of kept weights: the best model
        self.kept_step: int | None = None
        self.stopped_at: int | None = None

    @classmethod
    def from_options(cls, options: BestModelOptions, steps_per_epoch: int, total_steps: int) -> BestModel | None:
        """None unless one of the best-model or early-stopping flags is given."""
        if not (options.metric_for_best_model or options.load_best_model_at_end or options.early_stopping_patience):
            return None
        return cls(options.metric_for_best_model or "loss", options.greater_is_better, options.early_stopping_patience,
                   options.early_stopping_threshold, options.checkpointing_steps, steps_per_epoch, total_steps,
                   options.load_best_model_at_end)

    def _better(self, value: float, than: float | None) -> bool:
        if than is None:
            return not math.isnan(value)
        return value > than if self.greater else value < than

    def _value(self, metrics: dict[str, Any]) -> float:
        value = metrics.get(self.metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            known = ", ".join(k for k, v in metrics.items() if isinstance(v, float)) or "none"
            raise ConfigError(f"--metric_for_best_model {self.metric}: the evaluation has no such metric "
                              f"(it gives {known}); pick one of those")
        return float(value)

    def _kept(self, step: int) -> bool:
        """Are this step's weights kept: a scheduled checkpoint, or the run's final weights?"""
        if step >= self._total_steps or self.stopped_at == step:
            return True
        if self._save_steps == "epoch":
            return step % self._steps_per_epoch == 0
        return bool(self._save_steps) and step % int(self._save_steps) == 0

    def after_eval(self, metrics: dict[str, Any], step: int) -> bool:
        """Record the evaluation of ``step``; True when early stopping ends the run here (on every rank alike)."""
        value = self._value(metrics)
        if self.best_metric is None or (self._better(value, self.best_metric)
                                        and abs(value - self.best_metric) > self.threshold):
            self.counter = 0
        else:
            self.counter += 1
        if self._better(value, self.best_metric):
            self.best_metric = value
        if self.patience and self.counter >= self.patience and step < self._total_steps:
            self.stopped_at = step
        if self._kept(step) and self._better(value, self.kept_metric):
            self.kept_metric, self.kept_step = value, step
        return self.stopped_at == step

    # ---- in checkpoint.json, and back

    def state_dict(self) -> dict[str, Any]:
        """The records, for checkpoint.json's ``best`` (checkpoint/train_state.py)."""
        return {"metric": self.metric, "greater_is_better": self.greater, "best_metric": self.best_metric,
                "counter": self.counter, "best_step": self.kept_step, "best_step_metric": self.kept_metric}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the records of the checkpoint resumed from (one made without them, or for another metric or
        direction: start afresh)."""
        saved = state_dict
        if not isinstance(saved, dict) or saved.get("metric") != self.metric or saved.get("greater_is_better") != \
                self.greater:
            return
        self.best_metric, self.counter = saved["best_metric"], int(saved["counter"])
        self.kept_step, self.kept_metric = saved["best_step"], saved["best_step_metric"]

    def summary(self, final_step: int) -> dict[str, Any]:
        """summary.json's keys: which step is best, which step the final weights are, why the run stopped."""
        out = {"metric_for_best_model": self.metric, "greater_is_better": self.greater,
               "best_metric": self.kept_metric, "best_step": self.kept_step,
               "final_weights_step": self.kept_step if self.load_at_end and self.kept_step is not None
               else final_step}
        if self.stopped_at is not None:
            out["stopped_early"] = {
                "step": self.stopped_at,
                "reason": f"early stopping: {self.counter} evaluations without {self.metric} improving by more "
                          f"than {self.threshold} on {self.best_metric} (--early_stopping_patience {self.patience})"}
        return out

    def load_best(self, accelerator: Any, model: Any, local_folder: Callable[[int], str], step: int) -> None:
        """--load_best_model_at_end: put the best checkpoint's weights into ``model`` (every rank) before the export.

        The best is kept weights by construction (a checkpoint step, protected from pruning, or the final step,
        already in ``model``). ``local_folder(step)``: the checkpoint's folder, downloaded where it is in a store
        (collective: the condition above is the same on every rank).
        """
        if not self.load_at_end or self.kept_step is None or self.kept_step == step:
            return
        from accel_ddp.checkpoint.weights import load_weights
        from accel_ddp.outputs.names import WEIGHTS_NAME

        folder = local_folder(self.kept_step)
        load_weights(accelerator.unwrap_model(model, keep_torch_compile=False), os.path.join(folder, WEIGHTS_NAME),
                     source="--load_best_model_at_end", keep_frozen=True)
        if accelerator.is_main_process:
            say(f"--load_best_model_at_end: the final weights are {folder}'s ({self.metric} {self.kept_metric:.6g}, "
                f"step {self.kept_step} of {step})")


def check_eval_set(options: BestModelOptions, has_eval: bool) -> None:
    """The best model and early stopping rank evaluations: without an eval set the last weights would be exported
    as the best, and the patience never run out."""
    given = [flag for flag, on in (("--load_best_model_at_end", options.load_best_model_at_end),
                                   (f"--early_stopping_patience {options.early_stopping_patience}",
                                    options.early_stopping_patience)) if on]
    if given and not has_eval:
        raise ConfigError(f"{' and '.join(given)} rank evaluations, but --dataset {options.dataset} has no eval set; "
                          "give a dataset with an eval split, or drop the flag")
