"""What a model returned, read the same way everywhere: its logits (a tensor, or a ``logits`` field).

Below the tasks (which define the loss contract) so that the FLOP counter can read it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def logits_of(outputs: Any) -> torch.Tensor | None:
    """The logits of a model's output: the output itself if a tensor, else its ``logits`` field."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):  # also Transformers' ModelOutput
        return outputs.get("logits")
    return getattr(outputs, "logits", None)
