"""Evaluation on every rank; each eval sample is counted exactly once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader) -> dict[str, float]:
    """Mean loss and accuracy over the whole eval set, identical on every rank.

    ``gather_for_metrics`` drops the samples Accelerate repeats to give every rank an equal
    last batch, so ``eval_samples`` equals ``len(eval_dataset)`` for any world size. Sums stay
    on the device until the end: one host sync per evaluation, not per batch.
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    correct = torch.zeros((), device=accelerator.device, dtype=torch.long)
    count = 0
    for inputs, labels in loader:
        logits = model(inputs)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        losses, hits = accelerator.gather_for_metrics((losses, logits.argmax(dim=1) == labels))
        loss_sum += losses.sum(dtype=torch.float64)
        correct += hits.sum()
        count += hits.numel()
    model.train(was_training)
    denominator = max(count, 1)
    return {
        "eval_loss": loss_sum.item() / denominator,
        "eval_accuracy": correct.item() / denominator,
        "eval_samples": count,
    }
