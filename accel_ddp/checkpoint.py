"""Saving what training produced: the final weights (checkpoints and resume build on this)."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

WEIGHTS_NAME = "model.safetensors"


def export_weights(accelerator: Accelerator, model: torch.nn.Module, output_dir: str) -> str:
    """Write the unwrapped model's weights to ``output_dir/model.safetensors``.

    Every rank must call this (``get_state_dict`` is collective under sharded strategies); only
    the main process writes, into a temporary file renamed into place, so a crash mid-write
    never leaves a truncated ``model.safetensors`` behind.
    """
    state = accelerator.get_state_dict(model)
    path = os.path.join(output_dir, WEIGHTS_NAME)
    if accelerator.is_main_process:
        # safetensors refuses tensors that share storage; clone into plain contiguous CPU copies.
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state.items()}
        tmp = f"{path}.tmp"
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    accelerator.wait_for_everyone()
    return path
