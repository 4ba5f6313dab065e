"""Evaluation on every rank; each eval sample is counted exactly once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader) -> dict[str, float]:
    """Mean loss and accuracy over the whole eval set, identical on every rank.

    A prepared DataLoader repeats samples to give every rank an equal last batch;
    ``gather_for_metrics`` drops them, so ``eval_samples`` equals ``len(eval_dataset)`` for any
    world size. A loader that shards without padding (``sums_across_ranks``, the in-memory
    :class:`~accel_ddp.data.device_loader.DeviceEvalLoader`) needs no per-sample gather: each rank sums
    its own share and one all-reduce adds the sums. Either way the sums stay on the device until
    the end: one host sync per evaluation, not per batch.
    """
    was_training = model.training
    model.eval()
    sharded = getattr(loader, "sums_across_ranks", False)
    sums = torch.zeros(2, device=accelerator.device, dtype=torch.float64)  # loss sum, correct: exact below 2**53
    count = 0  # a host-side int: sample counts need no device sync
    for inputs, labels in loader:
        logits = model(inputs)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        hits = logits.argmax(dim=1) == labels
        if not sharded:
            losses, hits = accelerator.gather_for_metrics((losses, hits))
        sums += torch.stack([losses.sum(dtype=torch.float64), hits.sum(dtype=torch.float64)])
        count += hits.numel()
    totals = torch.cat([sums, sums.new_tensor([count])])
    if sharded and accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    loss_sum, correct, count = totals.tolist()
    denominator = max(count, 1)
    return {"eval_loss": loss_sum / denominator, "eval_accuracy": correct / denominator, "eval_samples": int(count)}
