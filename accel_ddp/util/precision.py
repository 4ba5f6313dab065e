"""Accelerate's ``mixed_precision`` and the dtype autocast computes in under it: the one map (the chunked loss's
matmuls, FSDP2's parameter dtype).

    >>> autocast_dtype("bf16")
    torch.bfloat16
    >>> autocast_dtype("no") is None
    True
"""

from __future__ import annotations

from typing import Any


def autocast_dtype(mixed_precision: Any):
    """``torch.bfloat16`` for ``bf16``, ``torch.float16`` for ``fp16``; None for ``no``, ``fp8`` (Transformer
    Engine's or torchao's own recipe, not autocast's) and anything else: the model's own dtype."""
    import torch  # only here: util is imported before torch (the CLI's --help, bad flags)

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed_precision))
