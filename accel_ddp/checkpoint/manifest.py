"""What a checkpoint folder must hold, and whether to trust it; whether this process's RNGs are those it saved.

    list_checkpoints("outputs/run/checkpoints")      # [(20, ".../step_00000020"), ...]: complete ones, oldest first
    meta = read_checkpoint(".../step_00000020")       # checkpoint.json, once every file proves what it says
    rng_not_restored(".../random_states_1.pkl")       # after load_state: None, or which generators differ

The small state files (scheduler, RNG) are read as Accelerate's ``load_state`` reads them:
``accelerate.utils.load``, i.e. ``torch.load(weights_only=True)`` with NumPy's RNG types
allow-listed (``TORCH_SAFE_GLOBALS``); nothing else is ever unpickled. Saving and resuming:
``checkpoint.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from accelerate.utils import RNG_STATE_NAME, SCALER_NAME
from accelerate.utils import load as accelerate_load
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME, SCHEDULER_NAME

from accel_ddp.outputs.files import file_sha256, relative_files
from accel_ddp.outputs.names import MARKER_NAME, WEIGHTS_NAME
from accel_ddp.util.messages import first_line
from accel_ddp.util.validation import ConfigError

STEP_DIR = re.compile(r"^step_(\d{8,})$")
SCHEDULER_FILE = f"{SCHEDULER_NAME}.bin"


class CorruptCheckpoint(ConfigError):
    """A file of a checkpoint is missing, truncated or altered since it was saved."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, folder)`` of every complete checkpoint (one with its marker) under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    try:
        names = os.listdir(root)
    except OSError as err:
        raise ConfigError(f"cannot list {root} ({err.strerror}); fix its permissions") from None
    found = []
    for name in names:
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, MARKER_NAME)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def read_checkpoint(folder: str) -> dict[str, Any]:
    """The checkpoint's ``checkpoint.json``, once the folder proves to be what it says.

    Every file it lists has its recorded size and sha256; it lists every file the format needs; its
    step is the folder's (``step_00000020`` holds step 20) and the scheduler's own step count; every
    rank's RNG file holds states that apply (a file intact by hash can still hold anything). Raises
    ``CorruptCheckpoint`` naming the first problem; a file we may not read counts as damaged too.
    """
    marker = os.path.join(folder, MARKER_NAME)
    if not os.path.isfile(marker):
        raise CorruptCheckpoint(f"{folder} is incomplete: it has no {MARKER_NAME}, so its save never finished")
    try:
        with open(marker, encoding="utf-8") as fh:
            meta = json.load(fh)
        files = {name: (int(f["bytes"]), str(f["sha256"])) for name, f in meta["files"].items()}
        if type(meta["step"]) is not int:
            raise TypeError("step")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CorruptCheckpoint(f"{marker} is unreadable or malformed") from None
    for name, (size, digest) in sorted(files.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CorruptCheckpoint(f"{path} is missing")
        if os.path.getsize(path) != size:
            raise CorruptCheckpoint(f"{path} is truncated or altered ({os.path.getsize(path)} bytes, {size} saved)")
        try:
            actual = file_sha256(path)
        except OSError as err:  # e.g. permissions: we cannot vouch for what we cannot read
            raise CorruptCheckpoint(f"{path} cannot be read ({err.strerror})") from None
        if actual != digest:
            raise CorruptCheckpoint(f"{path} is corrupt (its sha256 differs from the one recorded when it was saved)")
    missing = _required_files(meta, files)
    if missing:
        raise CorruptCheckpoint(f"{marker} does not list {', '.join(missing)}, which every checkpoint holds")
    _check_step(folder, meta)
    for rank in range(_ranks(meta)):  # each rank loads its own; any that would not restore is damage
        _check_rng_file(rng_file(folder, rank))
    return meta


def _required_files(meta: dict[str, Any], listed: Iterable[str]) -> list[str]:
    """What ``accelerator.save_state`` writes for our run that ``listed`` lacks: weights, optimizer, schedule,
    one RNG file per rank (and the fp16 scaler).

    Under FSDP Accelerate writes the model and optimizer its own way (``pytorch_model_fsdp_0/`` and
    ``optimizer_0/`` for a sharded state dict, single ``.bin`` files for a full one), so there we ask for
    a file of each kind rather than our ``model.safetensors`` and ``optimizer.bin``.
    """
    listed = set(listed)
    needed = [SCHEDULER_FILE, *(f"{RNG_STATE_NAME}_{rank}.pkl" for rank in range(_ranks(meta)))]
    if meta.get("mixed_precision") == "fp16":
        needed.append(SCALER_NAME)
    missing = [name for name in needed if name not in listed]
    if meta.get("distributed_type") == "FSDP":
        for prefix in (FSDP_MODEL_NAME, OPTIMIZER_NAME):
            if not any(name.startswith(prefix) for name in listed):
                missing.append(f"{prefix}* (FSDP)")
    else:
        missing += [name for name in (WEIGHTS_NAME, f"{OPTIMIZER_NAME}.bin") if name not in listed]
    return missing


def _ranks(meta: dict[str, Any]) -> int:
    world = meta.get("world_size")
    return world if type(world) is int and world > 0 else 1


def _check_step(folder: str, meta: dict[str, Any]) -> None:
    """The recorded step must be the folder's, the scheduler's, and on an optimizer-step boundary for Accelerate."""
    step = meta["step"]
    name = STEP_DIR.match(os.path.basename(os.path.normpath(folder)))
    if name and int(name.group(1)) != step:
        raise CorruptCheckpoint(f"{folder}: its {MARKER_NAME} says step {step}, its name says step "
                                f"{int(name.group(1))}")
    if step < 1:
        raise CorruptCheckpoint(f"{folder}: its {MARKER_NAME} says step {step}; checkpoints start at step 1")
    scheduler = _load_state(os.path.join(folder, SCHEDULER_FILE))
    scheduler_step = scheduler.get("last_epoch") if isinstance(scheduler, dict) else None
    if scheduler_step != step:
        raise CorruptCheckpoint(f"{folder}: its {MARKER_NAME} says step {step}, its {SCHEDULER_FILE} has "
                                f"stepped {scheduler_step} times")
    accumulation = meta.get("grad_accum_steps")
    rng = _load_state(os.path.join(folder, f"{RNG_STATE_NAME}_0.pkl"))
    micro_steps = rng.get("step") if isinstance(rng, dict) else None
    if type(accumulation) is int and accumulation > 0 and (type(micro_steps) is not int or micro_steps % accumulation):
        raise CorruptCheckpoint(f"{folder}: Accelerate's step counter ({micro_steps}) is not on an optimizer-step "
                                f"boundary of {accumulation} micro-steps")


def _load_state(path: str) -> Any:
    """A small state file saved by Accelerate, read as ``load_state`` will: ``torch.load(weights_only=True)``."""
    try:
        return accelerate_load(path, map_location="cpu")
    except ImportError:  # torch could not import its own code: this environment is broken, not the file
        raise
    except Exception as err:  # unpickling refused, truncated, unreadable: all mean we cannot resume from it
        raise CorruptCheckpoint(refusal_line(path, err)) from None


def refused_pickle(err: BaseException) -> str | None:
    """What torch's ``weights_only`` unpickler refused, in its own words, or None for any other error. Never its
    first lines: they advise re-running ``torch.load`` with ``weights_only=False``, i.e. running the file's code
    (torch/serialization.py ``_get_wo_message``)."""
    if not isinstance(err, pickle.UnpicklingError) or "weights_only" not in str(err):
        return None
    found = re.search(r"(?:Unsupported global: |Trying to load unsupported )GLOBAL [\w.]*\w|Unsupported operand \S+",
                      str(err))  # not the rest of its line either: advice to allowlist the global
    return found.group(0) if found else "an object of a type it does not allow"


def refusal_line(path: str, err: BaseException) -> str:
    """Why ``path`` cannot be loaded: objects a safe load refuses (a global: code to run), or the error's words."""
    refused = refused_pickle(err)
    if refused and "GLOBAL" in refused:
        return (f"{path} holds objects that a safe load (torch.load with weights_only=True) refuses ({refused}): no "
                "save of accel_ddp writes them, so it was altered; it is never unpickled otherwise")
    return f"{path} cannot be loaded ({type(err).__name__}: {refused or first_line(err)})"


def unsafe_file(folder: str) -> str | None:
    """After ``load_state`` raised an unpickling error: the line for the first pickle of ``folder`` that a safe load
    refuses, or None. Only then: ``optimizer.bin`` is not read before ``load_state`` (it may be gigabytes)."""
    for name in relative_files(folder):
        if name.endswith((".bin", ".pkl", ".pt")):
            path = os.path.join(folder, name)
            try:
                accelerate_load(path, map_location="cpu")
            except Exception as err:  # noqa: BLE001 - only the unpickler's refusal is an answer
                if refused_pickle(err):
                    return refusal_line(path, err)
    return None


# What Accelerate's save_accelerator_state writes into random_states_<rank>.pkl and load_accelerator_state sets
# (accelerate/checkpointing.py), on the devices this package runs on: Python's, NumPy's and torch's CPU generator,
# then CUDA's when CUDA is available. Other accelerators' keys (xpu, mlu, ...) are left to Accelerate.
RNG_KEYS = {"random_state": "Python", "numpy_random_seed": "NumPy", "torch_manual_seed": "torch CPU"}
CUDA_RNG_KEY = "torch_cuda_manual_seed"


def rng_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"{RNG_STATE_NAME}_{rank}.pkl")


def _check_rng_file(path: str) -> None:
    """The file must hold RNG states that apply: tried on this process's generators, which are then put back.

    Accelerate's ``load_accelerator_state`` catches any failure to load or apply a rank's RNG file and only
    logs it at INFO (huggingface/accelerate#4283): the resume would go on, no longer exact, without a word.
    """
    states = _load_state(path)
    missing = [key for key in RNG_KEYS if not isinstance(states, dict) or key not in states]
    if missing:
        raise CorruptCheckpoint(f"{path} holds no {', '.join(RNG_KEYS[key] for key in missing)} RNG state")
    saved = _current_rng()
    try:
        _set_rng(states)
    except Exception as err:  # noqa: BLE001 - each generator refuses a bad state with its own error type
        raise CorruptCheckpoint(f"{path} holds RNG states that do not apply ({type(err).__name__}: "
                                f"{first_line(err)})") from None
    finally:
        _set_rng(saved)
    cuda = states.get(CUDA_RNG_KEY)
    if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda)):
        raise CorruptCheckpoint(f"{path}: its CUDA RNG states are not a list of byte tensors")


def _current_rng() -> dict[str, Any]:
    return {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state()}


def _set_rng(states: dict[str, Any]) -> None:
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])


def rng_not_restored(path: str) -> list[str]:
    """After ``load_state``: the generators of this process whose state is not the one in its RNG file ``path``.

    Compares what ``load_accelerator_state`` sets (``RNG_KEYS``, and this process's CUDA devices that the file
    holds a state for); [] when the resume continues every random stream exactly.
    """
    try:
        states = _load_state(path)
    except CorruptCheckpoint:  # the main process read it when it chose the checkpoint: gone or changed since
        return ["every (the file no longer loads)"]
    now = _current_rng()
    differ = [name for key, name in RNG_KEYS.items() if not _same_state(now[key], states.get(key))]
    saved_cuda = states.get(CUDA_RNG_KEY)
    if saved_cuda is not None and torch.cuda.is_available():  # Accelerate sets them where CUDA is available
        current = torch.cuda.get_rng_state_all()
        differ += [f"CUDA device {i}" for i, (a, b) in enumerate(zip(current, saved_cuda, strict=False))
                   if not torch.equal(a, b)]
    return differ


def _same_state(a: Any, b: Any) -> bool:
    """Equal RNG states: tensors and NumPy arrays by value, tuples (Python's, NumPy's) element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b
