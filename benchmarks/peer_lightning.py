"""PyTorch Lightning on the MNIST CNN work of ``peers.py``, written as its docs write it.

A ``LightningModule`` around accel_ddp's ``mnist_cnn`` (the same layers), ``configure_optimizers`` returning
AdamW with a per-step cosine schedule, ``Trainer(accelerator="auto", devices=N, strategy="ddp",
gradient_clip_val=1.0)`` (its GPU where there is one; ``--mixed_precision bf16``: ``precision="bf16-mixed"``)
and ``trainer.fit(model, train_loader, val_loader)``: the loaders are plain
``DataLoader``s over the benchmark split as normalised float tensors in memory (the fastest input a
Lightning user writes; Lightning adds the ``DistributedSampler``), a validation pass after each epoch.
Everything else is Lightning's default: its logger, its checkpoint after each epoch, the progress bar off
(``TQDM_DISABLE`` as on accel_ddp's side). ``torch.optim.AdamW`` as the docs write it runs per tensor on the
CPU; ``--optimizer fused`` asks for the fused kernels accel_ddp asks for (the matched-work variant).
Launched the way accel_ddp is (``accelerate launch``: Lightning takes torchrun's environment):

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml benchmarks/peer_lightning.py \
        --epochs 3 --per_device_batch_size 64 --results_json /tmp/lightning.json

Timing as accel_ddp's ``EpochTimer``: per epoch, from its start to its last optimizer step, and the process's
CPU time over the same window (a ``Callback``); start-up from the process's start to the end of the first
optimizer step, the largest over the ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel_ddp.models import build_model  # noqa: E402
from accel_ddp.tracking.startup import process_age  # noqa: E402
from benchmarks.common import MNIST_MEAN, MNIST_STD, exit_now, load_split, slowest_rank  # noqa: E402


def loaders(batch: int) -> tuple[DataLoader, DataLoader]:
    """The benchmark split as normalised float tensors (the Normalize of examples/mnist, done once)."""
    sets = []
    for images, labels in zip(*[iter(load_split())] * 2, strict=True):
        x = (torch.from_numpy(images.copy()).unsqueeze(1).float() / 255.0 - MNIST_MEAN) / MNIST_STD
        sets.append(TensorDataset(x, torch.from_numpy(labels.copy())))
    return DataLoader(sets[0], batch_size=batch, shuffle=True, drop_last=True), DataLoader(sets[1], batch_size=batch)


def main() -> None:
    import lightning as L

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--per_device_batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=("default", "fused"), default="default",
                   help="default: torch.optim.AdamW as Lightning's docs write it; fused: accel_ddp's, fused AdamW")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed_precision", choices=("no", "bf16"), default="no",
                   help="bf16: Lightning's precision='bf16-mixed', as accel_ddp's side runs on a GPU")
    p.add_argument("--results_json", required=True)
    args = p.parse_args()
    started = time.perf_counter() - (process_age() or 0.0)
    L.seed_everything(args.seed, verbose=False)
    train_loader, val_loader = loaders(args.per_device_batch_size)

    class LitCNN(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model("mnist_cnn", 10, (1, 28, 28))

        def training_step(self, batch, _):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            logits = self.net(x)
            self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
            self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

        def configure_optimizers(self):
            if args.optimizer == "fused":
                from accel_ddp.optim.build import build_optimizer

                optimizer = build_optimizer("adamw", self, args.lr, 0.0, fused=True)
            else:
                optimizer = torch.optim.AdamW(self.parameters(), lr=args.lr, weight_decay=0.0)
            total = self.trainer.estimated_stepping_batches
            cosine = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / total)))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

    class EpochClock(L.Callback):
        """accel_ddp's EpochTimer window: an epoch's start to its last optimizer step (validation after it)."""

        def __init__(self):
            self.epochs, self.first_step_at = [], None

        def on_train_epoch_start(self, *_):
            self.begin, self.cpu, self.steps = time.perf_counter(), time.process_time(), 0

        def on_train_batch_end(self, *_):
            self.steps += 1
            self.last, self.last_cpu = time.perf_counter(), time.process_time()
            self.first_step_at = self.first_step_at or self.last

        def on_train_epoch_end(self, *_):
            self.epochs.append({"steps": self.steps, "seconds": self.last - self.begin,
                                "cpu_seconds": self.last_cpu - self.cpu})

    clock = EpochClock()
    with tempfile.TemporaryDirectory(prefix="peer_lightning_") as out:
        # accelerator="auto" (Lightning's default): its GPU where there is one, as accel_ddp picks the device itself
        trainer = L.Trainer(accelerator="auto", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                            precision="bf16-mixed" if args.mixed_precision == "bf16" else "32-true",
                            max_epochs=args.epochs,
                            gradient_clip_val=1.0, default_root_dir=out, callbacks=[clock],
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(LitCNN(), train_loader, val_loader)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    startup, rank_zero = slowest_rank(clock.first_step_at - started)
    if rank_zero:
        Path(args.results_json).write_text(json.dumps({
            "epochs": clock.epochs, "startup_sec": startup, "eval_loss": metrics.get("val_loss"),
            "mixed_precision": args.mixed_precision, "accelerator": type(trainer.accelerator).__name__,
            "eval_accuracy": metrics.get("val_acc"),
            "samples_per_step": args.per_device_batch_size * trainer.world_size,
            "optimizer_kernels": {k: v for k, v in trainer.optimizers[0].defaults.items() if k in ("foreach", "fused")},
        }))


if __name__ == "__main__":
    main()
    exit_now()  # past the gloo teardown race at finalization (common.exit_now)
