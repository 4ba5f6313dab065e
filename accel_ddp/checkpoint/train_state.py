"""The run's training state, one object handed to the checkpoint: what a save writes and a resume (or a rollback)
restores, as one.

    state = TrainState(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
                       best=best, anomalies=guard, positions=stream_loader)
    checkpoints = CheckpointManager(accelerator, output_dir, keep_last, run_facts, state=state)

Each part, and where it lives in a checkpoint folder (format 1: the layout of the checkpoints saved before this
object existed, which resume as they are):

- the weights: ``model.safetensors``, the unwrapped model's keys (no DDP ``module.`` prefix, no ``_orig_mod.``), so a
  checkpoint loads at any world size and a mismatch is reported key by key (this object's save/load hooks);
- the optimizer, the schedule (and fp16's scaler), every rank's RNGs: Accelerate's ``save_state``/``load_state`` of
  what ``accelerator.prepare`` registered (``optimizer.bin``, ``scheduler.bin``, ``random_states_<rank>.pkl``);
- the data position: the optimizer step (``checkpoint.json``; epochs have a fixed number of steps, so the sampler's
  place follows from it) and, for a stream, its readers' positions (``positions.state_dict()``, one JSON file per
  rank, ``POSITION_FILE``; data/streaming.py);
- the records: the best model's and early stopping's (``best``) and the anomaly log (``anomalies``), JSON in
  ``checkpoint.json`` (``records`` / ``restore_records``).

One protocol for every part: ``Stateful`` (``state_dict`` / ``load_state_dict``, torch.distributed.checkpoint's).

Not Accelerate's ``register_for_checkpointing``: its ``load_custom_state`` unpickles with ``weights_only=False``
(accelerate/checkpointing.py), and it would add a file that the checkpoints on disk do not have.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from accel_ddp.checkpoint.best import BestModel
from accel_ddp.checkpoint.weights import load_weights, trainable_state_dict
from accel_ddp.outputs.names import WEIGHTS_NAME


@runtime_checkable
class Stateful(Protocol):
    """Every part of the state: torch.distributed.checkpoint.stateful.Stateful's protocol (torch 2.x), declared here
    so that reading a checkpoint imports no torch.distributed.checkpoint. The model, optimizer and schedule are
    Stateful by torch; the best model's records (checkpoint/best.py), the anomaly log (bad_steps/) and a stream's
    position (data/streaming.py) by their own methods."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


POSITION_FILE = "data_state_rank{rank}.json"  # each rank's ``positions.state_dict()``, in every checkpoint folder
RECORDS = ("best", "anomalies")  # the parts kept as JSON in checkpoint.json, each under its name


def saved_positions(folder: str, rank: int) -> dict[str, Any]:
    """What a stream's ``load_state_dict`` gets from checkpoint ``folder``: rank 0's position and this ``rank``'s
    (each None where that rank saved none) and the folder (its warnings name it)."""
    def read(r: int) -> dict[str, Any] | None:
        path = os.path.join(folder, POSITION_FILE.format(rank=r))
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)

    first = read(0)
    return {"rank_0": first, "mine": first if rank == 0 else read(rank), "folder": folder}


@dataclass(frozen=True)
class TrainState:
    """Everything a checkpoint holds of a run (see the module docstring); the same object on every rank."""

    accelerator: Accelerator
    model: torch.nn.Module  # as accelerator.prepare returned it (DDP, FSDP or as is)
    optimizer: AcceleratedOptimizer
    scheduler: AcceleratedScheduler
    best: BestModel | None = None  # --metric_for_best_model, --early_stopping_patience: its records
    anomalies: Stateful | None = None  # --on_anomaly, --spike_factor: the steps left out, the rollbacks
    positions: Stateful | None = None  # a stream's readers; None where the step alone places the data

    def save_files(self, models: list[torch.nn.Module], weights: list[dict[str, Any]], folder: str) -> None:
        """Accelerate's save pre-hook: our weight files instead of its DDP-prefixed ones; the stream's positions."""
        for i, model in enumerate(models[: len(weights)]):
            # a fine-tuned model's frozen base is not saved (its fingerprint: checkpoint.json, transforms/finetune.py)
            weights[i] = trainable_state_dict(self.accelerator.unwrap_model(model, keep_torch_compile=False))
        for name, text in self.position_files().items():
            with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
                fh.write(text)

    def load_files(self, models: list[torch.nn.Module], folder: str) -> None:
        """Accelerate's load pre-hook: the weights loaded here (any world size), the stream's positions."""
        for i, model in enumerate(models):
            name = WEIGHTS_NAME if i == 0 else WEIGHTS_NAME.replace(".", f"_{i}.")
            load_weights(self.accelerator.unwrap_model(model, keep_torch_compile=False), os.path.join(folder, name),
                         source="--resume_from_checkpoint", keep_frozen=True)
        models.clear()  # loaded: Accelerate would expect DDP's "module." keys
        if self.positions is not None:
            self.positions.load_state_dict(saved_positions(folder, self.accelerator.process_index))

    def position_files(self) -> dict[str, str]:
        """This rank's data position file, taken now (``positions.state_dict()`` as JSON): {} where the step alone
        places the data."""
        if self.positions is None:
            return {}
        return {POSITION_FILE.format(rank=self.accelerator.process_index): json.dumps(self.positions.state_dict())}

    def records(self) -> dict[str, Any]:
        """``checkpoint.json``'s share of the state, taken at the save step: each record's ``state_dict()``."""
        return {name: part.state_dict() for name in RECORDS if (part := getattr(self, name)) is not None}

    def restore_records(self, meta: dict[str, Any]) -> None:
        """The records of the checkpoint resumed from (``checkpoint.json``); one saved without them starts them
        afresh (``load_state_dict({})``)."""
        for name in RECORDS:
            if (part := getattr(self, name)) is not None:
                part.load_state_dict(meta.get(name) or {})
