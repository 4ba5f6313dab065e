"""The global-batch order every training loader shares: a permutation per epoch, a position in global batches.

Optimizer step ``s`` of epoch ``e`` trains on ``epoch_order(N, steps * G, seed, e)[s * G:(s + 1) * G]``
whatever the world size and accumulation, so the position of a run is its optimizer step alone.
"""

from __future__ import annotations

import torch

from accel_ddp.config import ConfigError


def steps_per_epoch(num_train_samples: int, global_batch_size: int) -> int:
    """Optimizer steps in one epoch: the trailing partial global batch is dropped; none at all is an error."""
    steps = num_train_samples // global_batch_size
    if steps == 0:
        raise ConfigError(
            f"the training set has {num_train_samples} samples, fewer than one global batch "
            f"({global_batch_size}); lower --global_batch_size"
        )
    return steps


def epoch_order(num_samples: int, num_used: int, seed: int, epoch: int) -> torch.Tensor:
    """The first ``num_used`` indices of epoch ``epoch``'s permutation, drawn exactly as the DataLoader path draws them.

    Accelerate's ``SeedableRandomSampler`` seeds a fresh generator with ``seed + epoch`` and
    torch's ``RandomSampler`` (with ``num_samples <= len(dataset)``) keeps the first
    ``num_samples`` entries of ``torch.randperm(len(dataset))``: the same calls as here.
    """
    device = torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu"
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)[:num_used]
