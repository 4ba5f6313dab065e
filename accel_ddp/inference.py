"""Evaluate and predict with a trained run, on every rank of this launch: the run rebuilt from its config.yaml (the
process group, the task, the data and the model, by ``assemble``'s builders), its final weights or a checkpoint's
loaded, then the eval set passed once.

    from accel_ddp import evaluate, predict
    metrics = evaluate("outputs/run")                       # the run's final evaluation again: eval_loss, ...
    evaluate("outputs/run/checkpoints/step_00000040", out="eval.json")
    predict("outputs/run", "predictions.jsonl")            # one row per eval sample, in the eval set's order

The CLI: ``accel-ddp evaluate RUN_OR_CHECKPOINT [--out FILE]`` and ``accel-ddp predict RUN_OR_CHECKPOINT --out
FILE.jsonl`` (also under ``accelerate launch ... -m accel_ddp``). Nothing is written into the run's folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sized
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from accel_ddp.assemble import EvalLoader, build_run_model, build_world, claim_failure, configured_task
from accel_ddp.checkpoint.manifest import CorruptCheckpoint, read_checkpoint
from accel_ddp.checkpoint.weights import load_weights
from accel_ddp.config.debug import debug_mode
from accel_ddp.config.saved import evaluation_config
from accel_ddp.config.views import section_of
from accel_ddp.data.loaders import build_eval_loader_beside
from accel_ddp.data.resolve import DataOptions, resolve_data
from accel_ddp.evaluation import evaluate as evaluate_on_every_rank
from accel_ddp.evaluation import predictions
from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.outputs.files import written
from accel_ddp.outputs.trained import TrainedRun, find_trained
from accel_ddp.tasks.protocol import IGNORE_INDEX, Task
from accel_ddp.transforms.finetune import base_fingerprint
from accel_ddp.transforms.fused_activations import fuse_activations
from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.ranks import launch_world_size
from accel_ddp.util.validation import ConfigError


@dataclass(frozen=True)
class Rebuilt:
    """A trained run made ready to evaluate: its model holds the weights asked for, in eval mode."""

    trained: TrainedRun
    accelerator: Accelerator
    model: torch.nn.Module  # on the device, in the launch's mixed precision, not wrapped in DDP
    task: Task
    loader: EvalLoader  # the eval loader the run had (beside its training loader's kind), at this world size
    samples: int | None  # in the eval set; None for a stream


def evaluate(run: str | TrainedRun, out: str | None = None, *, data_dir: str | None = None, model=None,
             eval_dataset=None, collate_fn=None) -> dict[str, Any]:
    """The run's eval metrics (summary.json's keys: ``eval_loss``, ``eval_accuracy`` or the task's, ``eval_samples``)
    with its final weights, or a checkpoint's (``run``: ``OUTPUT_DIR/checkpoints/step_XXXXXXXX``); the same on every
    rank, and as the run's own evaluation of those weights (to float rounding) at any world size. ``optimizer_steps``
    says which weights. ``out``: also written there as JSON (main process). ``data_dir``: the run's data, where it is
    now if it moved. A run trained on objects of your own (``train(cfg, model=..., eval_dataset=...)``) cannot be
    rebuilt from its config.yaml: pass them again (``model`` of the same architecture: its weights are replaced).

        >>> evaluate("outputs/run")["eval_accuracy"]
        0.9583333333333334
    """
    with ExitStack() as teardown:
        rebuilt = rebuild(run, teardown, data_dir, model=model, eval_dataset=eval_dataset, collate_fn=collate_fn)
        metrics = evaluate_on_every_rank(rebuilt.accelerator, rebuilt.model, rebuilt.loader, rebuilt.task)
        result = {**metrics, "optimizer_steps": rebuilt.trained.step}
        if out is not None:
            _write(rebuilt.accelerator, out, json.dumps(result, indent=2) + "\n")
        return result


def predict(run: str | TrainedRun, out: str, *, data_dir: str | None = None, model=None, eval_dataset=None,
            collate_fn=None) -> int:
    """Write ``out`` (JSON Lines; main process): one row per eval sample, in the eval set's order, each sample once,
    the same file at any world size. Returns the number of rows.

    Classification (``classification``, ``sequence_classification``): ``{"index": 0, "prediction": 3, "label": 3}``,
    the likeliest class id and the sample's own (left out where the eval set has no labels). ``causal_lm``: per
    position that has a next token, the likeliest next token id and the real one, ``{"index": 0, "prediction": [..],
    "label": [..]}``. Either way the share of rows' predictions equal to their labels is ``eval_accuracy``.
    ``data_dir``, ``model``, ``eval_dataset``, ``collate_fn``: as for :func:`evaluate`.
    """
    with ExitStack() as teardown:
        rebuilt = rebuild(run, teardown, data_dir, model=model, eval_dataset=eval_dataset, collate_fn=collate_fn)
        fields = predictions(rebuilt.accelerator, rebuilt.model, rebuilt.loader, rebuilt.task)
        rows = prediction_rows(fields)
        if rebuilt.samples is not None and len(rows) != rebuilt.samples:  # the guarantee, checked: every sample once
            raise RuntimeError(f"predict made {len(rows)} rows for an eval set of {rebuilt.samples} samples")
        _write(rebuilt.accelerator, out, "".join(f"{row}\n" for row in rows))
        return len(rows)


def prediction_rows(fields: dict[str, torch.Tensor]) -> list[str]:
    """The JSON Lines rows of ``evaluation.predictions``' tensors (integers only: the same bytes at any world size).
    Token rows keep the positions that have a next token (label not -100)."""
    predicted, labels = fields["predictions"].tolist(), fields.get("labels")
    labels = labels.tolist() if labels is not None else None
    rows = []
    for index, prediction in enumerate(predicted):
        row: dict[str, Any] = {"index": index, "prediction": prediction}
        if labels is not None:
            row["label"] = labels[index]
        if isinstance(prediction, list):  # a sequence: its positions with a next token to predict
            kept = [i for i, label in enumerate(labels[index]) if label != IGNORE_INDEX]
            row["prediction"] = [prediction[i] for i in kept]
            row["label"] = [labels[index][i] for i in kept]
        rows.append(json.dumps(row))
    return rows


def rebuild(run: str | TrainedRun, teardown: ExitStack, data_dir: str | None = None, *, model=None, eval_dataset=None,
            collate_fn=None) -> Rebuilt:
    """Join this launch's process group and rebuild ``run`` as its training did: the task, the data, the model with
    the weights asked for (a checkpoint's proven whole first), the eval loader. ``teardown`` ends the group.
    ``model``, ``eval_dataset``, ``collate_fn``: the caller's, as ``train()`` takes them, instead of the config's."""
    trained = run if isinstance(run, TrainedRun) else find_trained(run, data_dir)
    cfg = evaluation_config(trained.options, trained.config_file, launch_world_size(), trained.checkpoint is not None)
    accelerator, per_device, _ = build_world(cfg)
    teardown.callback(accelerator.end_training)
    teardown.push(claim_failure)  # before the group goes: a failure is this rank's own, reported once per launch
    if accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError("evaluate and predict run the whole model on each rank; launch them with a DDP config (or "
                          "one process), not FSDP")
    set_seed(cfg.seed)  # as training did before it built the model (whose weights are then replaced)
    task = configured_task(cfg)
    # A caller's eval set stands in for the training set too: resolve_data reads its samples' shape from it
    data = resolve_data(section_of(cfg, DataOptions), accelerator, eval_dataset, eval_dataset, collate_fn)
    if data.eval is None:
        raise ConfigError(f"{trained.output_dir}: --dataset {cfg.dataset} has no eval set, so there is nothing to "
                          "evaluate or predict; give a run trained on a dataset with an eval split")
    given = model is not None
    model = build_run_model(cfg, accelerator, model, data, task)
    _load(accelerator, model, trained, given)
    if cfg.fused_kernels:  # what the run evaluated with: the same math, fewer kernels
        fuse_activations(model)
    model = accelerator.prepare_model(model, evaluation_mode=True)  # device, mixed precision; no DDP
    loader = build_eval_loader_beside(accelerator, data.eval, trained.facts.get("loader", "dataloader"),
                                      cfg.eval_batch_size or 2 * per_device, debug_mode(cfg).workers(cfg.num_workers),
                                      data.collate_fn)
    samples = len(data.eval) if isinstance(data.eval, Sized) else None
    return Rebuilt(trained, accelerator, model, task, loader, samples)


def _load(accelerator: Accelerator, model: torch.nn.Module, trained: TrainedRun, given: bool) -> None:
    """The final weights, or the checkpoint's once its manifest proves every file whole (every key and shape checked;
    a fine-tuned run's checkpoint holds the adapter only, checked against the base's fingerprint). ``given``: the
    caller passed the model."""
    source = "the run's weights" if trained.checkpoint is None else "the checkpoint's weights"
    try:
        _load_checked(accelerator, model, trained, source)
    except ConfigError as err:
        if given or "different model" not in str(err):
            raise
        raise ConfigError(f"{err} (trained on a model object of your own? pass it again: evaluate(run, model=...))"
                          ) from None


def _load_checked(accelerator: Accelerator, model: torch.nn.Module, trained: TrainedRun, source: str) -> None:
    if trained.checkpoint is None:
        load_weights(model, trained.weights, source=source)
        return
    meta = main_process_decides(accelerator, lambda: _verified(trained.checkpoint))
    if meta.get("distributed_type") == "FSDP":
        raise ConfigError(f"{trained.checkpoint} holds FSDP-sharded weights, which evaluate does not gather; evaluate "
                          "the run's final weights (its OUTPUT_DIR), or a DDP run's checkpoint")
    saved, ours = meta.get("base_fingerprint"), base_fingerprint(model)
    if saved != ours:
        raise ConfigError(f"{trained.checkpoint}: its weights belong to a base model of fingerprint {saved}, the "
                          f"rebuilt run's base has {ours}; give the run the base it was trained on (its --model, "
                          "--init_from)")
    load_weights(model, trained.weights, source=source, keep_frozen=saved is not None)


def _verified(folder: str) -> dict[str, Any]:
    try:
        return read_checkpoint(folder)
    except CorruptCheckpoint as err:
        raise ConfigError(f"{err}; evaluate an older checkpoint, or the run's final weights") from None


def _write(accelerator: Accelerator, path: str, text: str) -> None:
    """The main process writes ``path`` (a temporary file renamed into place); every rank learns a failure (one
    line: a full disk, a read-only folder, a folder in the way)."""
    folder = os.path.dirname(os.path.abspath(path))

    def write() -> None:
        if os.path.isdir(path):
            raise ConfigError(f"--out {path} is a folder; give a file path")
        os.makedirs(folder, exist_ok=True)
        atomic_write_text(path, text)

    main_process_decides(accelerator, lambda: written(write, os.path.basename(path), folder,
                                                      "free space there, or give another --out"))
