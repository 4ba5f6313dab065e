"""``--async_checkpointing``: copy the state to host memory at the save step, write it in a background thread.

The only pause of the training loop is :func:`snapshot`: each distinct tensor storage copied once into
host buffers reused from save to save (pinned under CUDA, with a non-blocking copy on the current stream
and an event the writer waits on: the next optimizer step is queued after the copies, so it cannot
change a tensor being copied), the small dicts deep-copied, and every rank's RNG state taken *now*, as
``accelerate.checkpointing.save_accelerator_state`` takes it (lines 155-178 of accelerate 1.15): the
files are the save step's state, bit for bit, so resuming one equals resuming a synchronous one.
``Accelerator.save_state`` cannot be split that way: it serialises the live objects and reads the RNG
when it writes.

The writer thread of each rank writes Accelerate's files (names, formats and functions of
``save_accelerator_state``: safetensors weights with tied aliases removed, ``torch.save`` for the
optimizer, schedule, scaler and RNG) into the ``.tmp-`` folder, to local paths only (``torch.save``
into a Python file object would hold the GIL per write), then drops ``.done-<rank>``. The main
process's writer seals (``CheckpointManager.seal``: hashes, ``checkpoint.json`` last, rename) once
every rank's marker is there, then prunes: a crash at any point before the rename leaves the previous
checkpoint the newest intact one. At most one save is in flight: the next save, a preemption and the
end of training first :meth:`AsyncSaver.wait`, whose gather of every rank's outcome is the same
collective the synchronous save ends with: a write that failed on any rank is one ``WriteFailed``
on every rank, at the same step. Not for FSDP or DeepSpeed (their ``save_state`` is collective).
"""

from __future__ import annotations

import copy
import os
import shutil
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from accelerate import checkpointing as acc_ckpt
from accelerate.utils import gather_object
from accelerate.utils import save as accelerate_save

from accel_ddp.checkpoint.manifest import rng_file
from accel_ddp.checkpoint.weights import trainable_state_dict
from accel_ddp.outputs.files import WriteFailed, write_failure
from accel_ddp.outputs.names import WEIGHTS_NAME
from accel_ddp.util.validation import ConfigError, ServiceFailure

DONE_PREFIX = ".done-"  # + rank: that rank's files are written (removed before the seal hashes the folder)
FAILED_PREFIX = ".failed-"  # + rank: that rank's write failed; the file holds why
POLL_SECONDS = 0.02
ABANDON_WAIT_S = 30.0  # how long a failing process waits for its writer to fail too (or finish) before it exits


class AsyncSaver:
    """One background writer per rank; ``save`` returns once the state is in host memory."""

    def __init__(self, manager: Any, model: Any, optimizer: Any, scheduler: Any, peer_timeout: float):
        self.manager, self.model, self.optimizer, self.scheduler = manager, model, optimizer, scheduler
        self.peer_timeout = peer_timeout  # seconds the sealing writer waits for the other ranks' markers
        self._buffers: dict[str, torch.Tensor] = {}  # host copies, reused: one save in flight, so one set
        self._thread: threading.Thread | None = None
        self._pending: tuple[int, str, str] | None = None  # step, tmp, final of the save in flight
        self._outcome: str | None = None  # why this rank's write (or the main's seal) failed
        self._bug = False  # the failure was not the file system's: reported as an error, not "free space"

    def save(self, step: int, tmp: str, final: str) -> None:
        """The previous save sealed, the state copied to host memory, the write started (every rank)."""
        self.wait()
        acc = self.manager.accelerator
        state = snapshot(acc, self.model, self.optimizer, self.scheduler, self._buffers)
        state["files"] = self.manager.state.position_files()  # a stream's positions at this step (train_state.py)
        self._pending, self._outcome = (step, tmp, final), None
        self._thread = threading.Thread(target=self._write, args=(state, step, tmp, final), daemon=True,
                                        name=f"accel_ddp-checkpoint-{step}")
        self._thread.start()

    def wait(self) -> str | None:
        """Collective: block until the save in flight is sealed; its folder, or None when none was in flight."""
        if self._pending is None:
            return None
        self._thread.join()
        step, tmp, final = self._pending
        self._pending = None
        problems = [(why, bug) for why, bug in gather_object([(self._outcome, self._bug)]) if why]
        if problems:
            if self.manager.accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            why, bug = problems[0]
            if bug == "store":
                raise ConfigError(why)  # store_calls.StoreError: the store refused the run (its lock lost)
            if bug == "store-failed":
                raise ServiceFailure(why)  # store_calls.StoreFailed: the store failed mid-run (exit 1)
            if bug:
                raise RuntimeError(f"the checkpoint writer of step {step} failed: {why}")
            raise WriteFailed(self.manager.cannot_save(step, why))
        self.manager.last_saved_step, self.manager.last_saved_folder = step, final  # a pair: both sealed
        return final

    def failed_here(self, timeout: float = ABANDON_WAIT_S) -> str | None:
        """Not collective: this process is stopping on a write the file system refused (a metrics line: the disk
        the save filled). If this rank's write of the save in flight failed too, the save is named instead and its
        ``.tmp-`` folder removed (main process): the line, or None (no save in flight, or it did not fail)."""
        if self._pending is None:
            return None
        self._thread.join(timeout)  # a full disk fails the writer as fast as the metrics line
        if self._thread.is_alive() or self._outcome is None or self._bug is not False:
            return None
        step, tmp, _ = self._pending
        self._pending = None
        if self.manager.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        return self.manager.cannot_save(step, self._outcome)

    @property
    def pending_step(self) -> int | None:
        """The step of the save in flight (not yet waited for), or None."""
        return None if self._pending is None else self._pending[0]

    def _write(self, state: dict[str, Any], step: int, tmp: str, final: str) -> None:
        acc = self.manager.accelerator
        rank = acc.process_index
        try:
            write_state(state, tmp, rank)
            _touch(os.path.join(tmp, f"{DONE_PREFIX}{rank}"), "")
        except Exception as err:  # noqa: BLE001 - reported by wait() on every rank
            self._fail(err, tmp)
            _touch(os.path.join(tmp, f"{FAILED_PREFIX}{rank}"), self._outcome, quiet=True)
            return
        if acc.is_main_process:
            try:
                self._seal_when_all_written(step, tmp, final, acc.num_processes)
            except Exception as err:  # noqa: BLE001 - reported by wait() on every rank
                self._fail(err, tmp)

    def _fail(self, err: Exception, tmp: str) -> None:
        if isinstance(err, (ConfigError, ServiceFailure)):  # the object store's refusal or failure: its own line
            self._outcome, self._bug = str(err), "store" if isinstance(err, ConfigError) else "store-failed"
            return
        why = write_failure(err, tmp)
        self._outcome, self._bug = why or f"{type(err).__name__}: {err}", why is None

    def _seal_when_all_written(self, step: int, tmp: str, final: str, world: int) -> None:
        deadline = time.monotonic() + self.peer_timeout
        while True:
            names = set(os.listdir(tmp))
            failed = sorted(n for n in names if n.startswith(FAILED_PREFIX))
            if failed:
                with open(os.path.join(tmp, failed[0]), encoding="utf-8") as fh:
                    self._outcome = fh.read() or f"rank {failed[0][len(FAILED_PREFIX):]}'s write failed"
                return
            if all(f"{DONE_PREFIX}{rank}" in names for rank in range(world)):
                break
            if time.monotonic() > deadline:
                self._outcome = f"not every rank wrote its files within {self.peer_timeout:.0f} s"
                return
            time.sleep(POLL_SECONDS)
        for rank in range(world):
            os.remove(os.path.join(tmp, f"{DONE_PREFIX}{rank}"))
        self.manager.seal(tmp, final, step)
        self.manager.prune(keep=final)


def check_async_checkpointing(acc: Any) -> None:
    """Sharded strategies save through collectives of their own (Accelerate's save_state): not in a thread."""
    kind = str(acc.distributed_type.value)
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        raise ConfigError(f"--async_checkpointing is not supported with {kind} yet (its save is collective); "
                          "drop --async_checkpointing")


def snapshot(acc: Any, model: Any, optimizer: Any, scheduler: Any, buffers: dict[str, torch.Tensor]) -> dict:
    """This rank's part of the checkpoint, in host memory; the main process holds all but the other ranks' RNG."""
    state: dict[str, Any] = {"rng": rng_state(acc.step)}
    if acc.is_main_process:  # Accelerate's save writes weights, optimizer, schedule and scaler from it alone
        copies: dict[tuple, torch.Tensor] = {}  # tied weights stay one storage: save() drops the same aliases
        weights = trainable_state_dict(acc.unwrap_model(model, keep_torch_compile=False))  # as the save hook's
        state["weights"] = OrderedDict((k, _host(v, f"w.{k}", buffers, copies)) for k, v in weights.items())
        state["optimizer"] = _host_tree(optimizer.state_dict(), "o", buffers)
        state["scheduler"] = copy.deepcopy(scheduler.state_dict())
        if acc.scaler is not None:
            state["scaler"] = copy.deepcopy(acc.scaler.state_dict())
        if torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()  # the writer waits for the non-blocking copies enqueued above
            state["event"] = event
    return state


def rng_state(step: int) -> dict[str, Any]:
    """The dict ``save_accelerator_state`` writes to ``random_states_<rank>.pkl``, taken at the save step."""
    import random

    states: dict[str, Any] = {"step": step, "random_state": random.getstate(),
                              "numpy_random_seed": np.random.get_state(), "torch_manual_seed": torch.get_rng_state()}
    # The device generators under the keys save_accelerator_state writes and load_accelerator_state reads for
    # them, in accelerate 1.15 (is_xpu_available/is_cuda_available) and 1.16 (get_torch_accelerator_backend: the
    # native module's get_rng_state_all for both). Asked of torch, not of accelerate.checkpointing's imports,
    # which 1.16 renamed.
    for device in ("xpu", "cuda"):
        module = getattr(torch, device, None)
        if module is not None and module.is_available():
            states[f"torch_{device}_manual_seed"] = module.get_rng_state_all()
    return states


def write_state(state: dict[str, Any], folder: str, rank: int) -> None:
    """Write ``state`` as ``save_accelerator_state`` would (same names, same functions), to local paths."""
    if (event := state.get("event")) is not None:
        event.synchronize()
    if "weights" in state:
        accelerate_save(state["weights"], os.path.join(folder, WEIGHTS_NAME), safe_serialization=True)
        accelerate_save(state["optimizer"], os.path.join(folder, f"{acc_ckpt.OPTIMIZER_NAME}.bin"))
        accelerate_save(state["scheduler"], os.path.join(folder, f"{acc_ckpt.SCHEDULER_NAME}.bin"))
        if "scaler" in state:
            torch.save(state["scaler"], os.path.join(folder, acc_ckpt.SCALER_NAME))
    torch.save(state["rng"], rng_file(folder, rank))
    for name, text in state.get("files", {}).items():  # small JSON files: a stream's positions
        with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
            fh.write(text)


def _host(t: torch.Tensor, name: str, buffers: dict[str, torch.Tensor], copies: dict[tuple, torch.Tensor]):
    key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    if key in copies:
        return copies[key]
    buf = buffers.get(name)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        buffers[name] = buf
    buf.copy_(t.detach(), non_blocking=t.is_cuda)
    copies[key] = buf
    return buf


def _host_tree(obj: Any, name: str, buffers: dict[str, torch.Tensor]) -> Any:
    """A copy of a state dict with every tensor in host memory (reused buffers) and everything else deep-copied."""
    if isinstance(obj, torch.Tensor):
        return _host(obj, name, buffers, {})
    if isinstance(obj, dict):
        return type(obj)((k, _host_tree(v, f"{name}.{k}", buffers)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_tree(v, f"{name}.{i}", buffers) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def _touch(path: str, text: str, quiet: bool = False) -> None:
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError:
        if not quiet:
            raise
