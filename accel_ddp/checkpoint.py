"""Checkpoints: atomic saves, keep-last-N, exact resume (weight files: ``weights.py``).

Layout under ``OUTPUT_DIR/checkpoints/``:

    step_00000120/                 one complete checkpoint (a folder only gets this name once complete)
        model.safetensors          unwrapped weights, the same keys as OUTPUT_DIR/model.safetensors
        optimizer.bin              \\
        scheduler.bin               } accelerator.save_state (scaler.pt too under fp16)
        random_states_<rank>.pkl   /  one per rank: Python, NumPy, torch and CUDA RNG states
        checkpoint.json            the completion marker, written last: step, epoch, run facts, and the
                                   size and sha256 of every other file
    .tmp-step_00000140/            a save in progress, or one a crash interrupted: never loaded

Saving (``CheckpointManager.save``, collective): every rank writes into the ``.tmp-`` folder; a
barrier; the main process hashes and fsyncs every file, writes ``checkpoint.json``, renames the
folder into place (atomic on POSIX) and only then prunes checkpoints beyond ``--keep_last``, never
the one just written nor any newer one. A crash at any point leaves every earlier checkpoint as it
was. A folder already holding the step (a damaged one ``auto`` skipped) is renamed ``*.damaged``.
Accelerate's own ``total_limit`` rotation is not used: it deletes the oldest checkpoint before the
new one is written, and writes in place.

Resuming (``CheckpointManager.resume``): ``auto`` takes the newest folder that ``read_checkpoint``
trusts (files match ``checkpoint.json``, which lists every file the format needs; its step is the
folder's and the scheduler's); a damaged one is skipped with a warning, an explicit damaged path is
exit 2. A checkpoint past the run's total step count, or an explicit older one while intact newer
ones exist, is refused: resuming would overwrite them. The run's hyperparameters win over the
checkpoint's (``flags_in_force``, with a warning). The training position is the
optimizer step alone: epochs have a fixed number of steps, so the loop recomputes the epoch and
fast-forwards the loader. Accelerate's ``load_state`` reads optimizer, scheduler, scaler and RNG
files through ``accelerate.utils.load``, i.e. ``torch.load(weights_only=True)`` with NumPy's RNG
types allow-listed; we never register custom objects (Accelerate unpickles those with
``weights_only=False``): the position lives in JSON. Signals and exit codes: ``preemption.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import RNG_STATE_NAME, SCALER_NAME, gather_object
from accelerate.utils import load as accelerate_load
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME, SCHEDULER_NAME

from accel_ddp.failure import first_line, main_process_decides
from accel_ddp.files import (
    WriteFailed,
    file_sha256,
    fingerprint,
    fsync_dir,
    relative_files,
    remove_dir,
    set_aside,
    write_failure,
)
from accel_ddp.outputs import CHECKPOINTS_DIR, MARKER_NAME, SUMMARY_NAME, WEIGHTS_NAME
from accel_ddp.validation import ConfigError
from accel_ddp.weights import load_weights, plain_state_dict

FORMAT_VERSION = 1
# Run facts that decide what an optimizer step means; a checkpoint made with other values cannot continue.
# A stream has no epoch length: its steps_per_epoch is the run's --max_steps, which a longer run raises.
MUST_MATCH = ("global_batch_size", "steps_per_epoch", "optimizer")
# Recorded in every checkpoint.json; a resume with other values warns, and this run's values are in force.
HYPERPARAMETERS = ("lr", "lr_schedule", "warmup_steps", "weight_decay", "max_grad_norm")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
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
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, MARKER_NAME)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def read_checkpoint(folder: str) -> dict[str, Any]:
    """The checkpoint's ``checkpoint.json``, once the folder proves to be what it says.

    Every file it lists has its recorded size and sha256; it lists every file the format needs; its
    step is the folder's (``step_00000020`` holds step 20) and the scheduler's own step count. Raises
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
    return meta


def _required_files(meta: dict[str, Any], listed: Iterable[str]) -> list[str]:
    """What ``accelerator.save_state`` writes for our run that ``listed`` lacks: weights, optimizer, schedule,
    one RNG file per rank (and the fp16 scaler).

    Under FSDP Accelerate writes the model and optimizer its own way (``pytorch_model_fsdp_0/`` and
    ``optimizer_0/`` for a sharded state dict, single ``.bin`` files for a full one), so there we ask for
    a file of each kind rather than our ``model.safetensors`` and ``optimizer.bin``.
    """
    listed = set(listed)
    world = meta.get("world_size")
    ranks = world if type(world) is int and world > 0 else 1
    needed = [SCHEDULER_FILE, *(f"{RNG_STATE_NAME}_{rank}.pkl" for rank in range(ranks))]
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


def _check_step(folder: str, meta: dict[str, Any]) -> None:
    """The recorded step must be the folder's, the scheduler's, and on an optimizer-step boundary for Accelerate."""
    step = meta["step"]
    name = _STEP_DIR.match(os.path.basename(os.path.normpath(folder)))
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
        raise CorruptCheckpoint(f"{path} cannot be loaded ({type(err).__name__}: {first_line(err)})") from None


@contextmanager
def flags_in_force(optimizer: Any, scheduler: Any) -> Iterator[None]:
    """Keep this run's hyperparameters across a ``load_state`` inside the block.

    ``load_state`` restores the optimizer's param groups (lr, weight decay, betas, ...) and the schedule's
    peak LR from the checkpoint, while the schedule's shape and clipping come from the flags: a mix nobody
    asked for. Here the flags win, all of them, and the LR is recomputed for the restored step. Unchanged
    flags give back the very floats the checkpoint holds, so an unchanged resume stays bitwise exact.

        >>> with flags_in_force(optimizer, scheduler):
        ...     step = checkpoints.resume("auto")
    """
    fresh = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    schedule = getattr(scheduler, "scheduler", scheduler)  # Accelerate's AcceleratedScheduler wraps it
    base_lrs = list(schedule.base_lrs)
    yield
    for group, values in zip(optimizer.param_groups, fresh, strict=True):
        group.update(values)
    schedule.base_lrs = base_lrs
    if lambdas := getattr(schedule, "lr_lambdas", None):  # LambdaLR: lr = peak x multiplier(step)
        lrs = [base * fn(schedule.last_epoch) for base, fn in zip(base_lrs, lambdas, strict=True)]
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        schedule._last_lr = lrs


class CheckpointManager:
    """Saves and restores the full training state of one run under ``OUTPUT_DIR/checkpoints``.

    ``save``, ``resume`` and ``check_fresh_start`` are collective: every rank calls them at the same
    point. ``run_facts`` (world size, global batch, steps per epoch, ...) go into every
    ``checkpoint.json`` and are compared on resume.

        >>> checkpoints = CheckpointManager(accelerator, "outputs/run", keep_last=3, run_facts=facts)
        >>> step = checkpoints.resume("auto")           # 0 when there is nothing to resume
        >>> checkpoints.save(step)                       # -> "outputs/run/checkpoints/step_00000100"
    """

    def __init__(self, accelerator: Accelerator, output_dir: str, keep_last: int, run_facts: dict[str, Any]):
        self.accelerator = accelerator
        self.root = os.path.join(output_dir, CHECKPOINTS_DIR)
        self.keep_last = keep_last
        self.run_facts = dict(run_facts)
        self.last_saved_step: int | None = None
        self.last_saved_folder: str | None = None  # the newest checkpoint this run saved or resumed from
        # We write and read the weights ourselves, without DDP's "module." prefix, so that a checkpoint
        # loads at any world size and a mismatch is reported key by key.
        accelerator.register_save_state_pre_hook(self._unwrapped_weights_hook)
        accelerator.register_load_state_pre_hook(self._load_weights_hook)

    # ---- saving

    def save(self, step: int) -> str:
        """Save the full training state after optimizer ``step``; returns the checkpoint folder."""
        final = os.path.join(self.root, checkpoint_name(step))
        if step == self.last_saved_step:  # e.g. preempted right after a scheduled save, or right after resuming
            return final
        acc = self.accelerator
        tmp = os.path.join(self.root, f".tmp-{checkpoint_name(step)}")
        # Each stage ends in a collective that carries its outcome: a write the file system refuses (a full disk)
        # on any rank stops every rank with one line, the unsealed folder removed and the earlier checkpoints as
        # they were. The main process's stages are its decisions; each rank writes its own RNG file.
        self._on_main_then_all(lambda: self._writing(step, tmp, lambda: _fresh_folder(tmp)))
        try:
            acc.save_state(tmp)  # each rank writes its RNG state; the main process everything else
            mine = None
        except Exception as err:
            mine = write_failure(err, tmp)
            if mine is None:
                raise
        problems = [why for why in gather_object([mine]) if why]  # every rank has written, or knows who could not
        if problems:
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise WriteFailed(self._cannot_save(step, problems[0]))
        self._on_main_then_all(lambda: self._writing(step, tmp, lambda: (self._seal(tmp, final, step),
                                                                         self._prune(keep=final))))
        self.last_saved_step, self.last_saved_folder = step, final
        return final

    def _writing(self, step: int, tmp: str, call: Callable[[], Any]) -> None:
        """``call()`` on the main process; a write the file system refuses removes ``tmp`` and is a WriteFailed."""
        try:
            call()
        except Exception as err:
            why = write_failure(err, tmp)
            if why is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise WriteFailed(self._cannot_save(step, why)) from err

    def _cannot_save(self, step: int, why: str) -> str:
        intact = f" ({os.path.basename(self.last_saved_folder)}, the last checkpoint, is intact)" \
            if self.last_saved_folder else ""
        return (f"cannot save the checkpoint of step {step} in {self.root}: {why}; free space there (a lower "
                f"--keep_last keeps fewer checkpoints) or give another --output_dir, then resume with "
                f"--resume_from_checkpoint auto{intact}")

    def _seal(self, tmp: str, final: str, step: int) -> None:
        files = {name: fingerprint(os.path.join(tmp, name)) for name in relative_files(tmp)}
        steps_per_epoch = self.run_facts["steps_per_epoch"]
        meta = {"format": FORMAT_VERSION, "step": step, "epoch": step // steps_per_epoch,
                "step_in_epoch": step % steps_per_epoch, **self.run_facts,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
        marker = os.path.join(tmp, MARKER_NAME)
        with open(marker, "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(final):  # a damaged checkpoint of this step, which auto skipped: kept, under another name
            aside = set_aside(final)
            _warn(f"{final} was damaged; moved it to {aside} and saved step {step} in its place")
        os.rename(tmp, final)
        fsync_dir(self.root)

    def _prune(self, keep: str) -> None:
        """Delete all but the newest ``keep_last`` checkpoints up to ``keep`` (the one just saved).

        Newer ones are never ours to delete: they can only be damaged ones that ``auto`` skipped (a resume
        from an older step with intact newer checkpoints is refused), left for their owner to look at.
        """
        saved = int(_STEP_DIR.match(os.path.basename(keep)).group(1))
        complete = [path for step, path in list_checkpoints(self.root) if step <= saved]
        for path in complete[: max(len(complete) - self.keep_last, 0)]:
            if path != keep:
                remove_dir(path)
        for name in os.listdir(self.root):  # debris of saves or deletions a crash interrupted
            if name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _unwrapped_weights_hook(self, models, weights, output_dir) -> None:
        for i, model in enumerate(models[: len(weights)]):
            weights[i] = plain_state_dict(self.accelerator.unwrap_model(model, keep_torch_compile=False).state_dict())

    # ---- resuming

    def check_fresh_start(self) -> None:
        """Refuse to start from scratch over the checkpoints of an earlier run in the same folder."""
        def refuse_existing() -> None:
            existing = list_checkpoints(self.root)
            if existing:
                raise ConfigError(
                    f"{self.root} already holds checkpoints (newest {os.path.basename(existing[-1][1])}); "
                    "continue that run with --resume_from_checkpoint auto, or pick another --output_dir")
        self._on_main_then_all(refuse_existing)

    def resume(self, spec: str) -> int:
        """Restore the state named by ``spec`` (``auto`` or a checkpoint folder) on every rank.

        Returns the optimizer step to continue after; 0 when ``auto`` found no checkpoint.
        """
        choice = self._on_main_then_all(lambda: self._choose(spec))
        if choice is None:
            return 0
        folder, meta = choice
        self._check_compatible(folder, meta)
        acc = self.accelerator
        rng_file = os.path.join(folder, f"{RNG_STATE_NAME}_{acc.process_index}.pkl")
        has_rng = os.path.isfile(rng_file)
        try:
            acc.load_state(folder)
        except (ConfigError, torch.OutOfMemoryError):
            raise
        except Exception as err:  # torch.load or load_state_dict refused a file the manifest vouched for
            raise ConfigError(f"--resume_from_checkpoint {folder}: cannot load it ({type(err).__name__}: "
                              f"{first_line(err)}); resume from another checkpoint") from err
        acc.step = 0  # checkpoints sit on optimizer-step boundaries: the accumulation counter restarts there
        missing_rng = int(acc.reduce(torch.tensor(0 if has_rng else 1, device=acc.device), "sum").item())
        if missing_rng and acc.is_main_process:
            _warn(f"{folder} holds no RNG state for {missing_rng} of this run's {acc.num_processes} ranks "
                  f"(it was saved by {meta.get('world_size')}); those ranks keep their seeded RNG, so random "
                  "layers such as dropout will not replay the original run exactly")
        if acc.is_main_process:
            epoch = meta["step"] // self.run_facts["steps_per_epoch"]
            print(f"accel_ddp: resumed from {folder} (optimizer step {meta['step']}, epoch {epoch})", flush=True)
        self.last_saved_step, self.last_saved_folder = meta["step"], folder
        return meta["step"]

    def _choose(self, spec: str) -> tuple[str, dict[str, Any]] | None:
        if spec == "auto":
            candidates = list_checkpoints(self.root)
            if not candidates:
                print(f"accel_ddp: no checkpoint in {self.root}; starting from scratch", flush=True)
                return None
            for _, folder in reversed(candidates):
                try:
                    meta = read_checkpoint(folder)
                except CorruptCheckpoint as err:
                    _warn(f"skipping a damaged checkpoint: {err}; falling back to the previous one")
                    continue
                self._check_within_run(folder, meta)
                return folder, meta
            raise ConfigError(f"--resume_from_checkpoint auto: all {len(candidates)} checkpoints in {self.root} "
                              "are damaged (see the warnings above); move them away to start from scratch")
        if not os.path.isdir(spec):
            raise ConfigError(f"--resume_from_checkpoint {spec}: no such folder; give a checkpoint folder "
                              f"(e.g. {os.path.join(self.root, checkpoint_name(100))}) or auto")
        if not os.path.isfile(os.path.join(spec, MARKER_NAME)) and os.path.isdir(os.path.join(spec, CHECKPOINTS_DIR)):
            raise ConfigError(f"--resume_from_checkpoint {spec} is a run folder; give one of its "
                              f"{CHECKPOINTS_DIR}/step_* folders, or --output_dir {spec} with auto")
        try:
            meta = read_checkpoint(spec)
        except CorruptCheckpoint as err:
            raise ConfigError(f"--resume_from_checkpoint {spec}: {err}; resume from an older checkpoint, or use "
                              "auto, which skips damaged ones") from None
        self._check_within_run(spec, meta)
        self._refuse_to_mix_runs(spec)
        self._refuse_to_overwrite_newer(spec, meta["step"])
        return spec, meta

    def _refuse_to_mix_runs(self, spec: str) -> None:
        """Branching off another run's checkpoint goes into a folder of its own: this folder's checkpoints,
        metrics and final outputs would otherwise be rewound, mixed with that run's, pruned or overwritten."""
        if os.path.realpath(os.path.dirname(os.path.normpath(spec))) == os.path.realpath(self.root):
            return  # one of this folder's own checkpoints
        output_dir = os.path.dirname(self.root)
        held = [f"{CHECKPOINTS_DIR}/"] if list_checkpoints(self.root) else []
        held += [SUMMARY_NAME] if os.path.isfile(os.path.join(output_dir, SUMMARY_NAME)) else []
        if held:
            raise ConfigError(f"--resume_from_checkpoint {spec} belongs to another run, and --output_dir {output_dir} "
                              f"already holds one ({', '.join(held)}); branch off into an empty --output_dir")

    def _check_within_run(self, folder: str, meta: dict[str, Any]) -> None:
        """A checkpoint past this run's last step belongs to a longer run: resuming an older one instead would
        overwrite that run's model.safetensors and summary.json, so refuse rather than skip it."""
        total = self.run_facts.get("total_steps")
        if total is not None and meta["step"] > total:
            raise ConfigError(f"--resume_from_checkpoint {folder}: it holds step {meta['step']}, past this run's "
                              f"last step {total} (were --epochs or --max_steps lowered?); resume with the options "
                              "of the run that saved it, or give another --output_dir")

    def _refuse_to_overwrite_newer(self, spec: str, step: int) -> None:
        """Going back to an older checkpoint would overwrite (and prune) this folder's intact newer ones."""
        for newer_step, folder in list_checkpoints(self.root):
            if newer_step <= step:
                continue
            try:
                read_checkpoint(folder)
            except CorruptCheckpoint:
                continue  # damaged: auto would skip it too; it is set aside, not deleted, if this run reaches it
            raise ConfigError(f"--resume_from_checkpoint {spec}: {self.root} holds a newer checkpoint, "
                              f"{os.path.basename(folder)}, that this run would overwrite; continue from the newest "
                              "with auto, or give this run another --output_dir")

    def _check_compatible(self, folder: str, meta: dict[str, Any]) -> None:
        streams = meta.get("loader") == self.run_facts.get("loader") == "streaming"
        for key in MUST_MATCH:
            if key in meta and meta[key] != self.run_facts.get(key) and not (streams and key == "steps_per_epoch"):
                raise ConfigError(f"--resume_from_checkpoint {folder}: it was made with {key} {meta[key]}, this run "
                                  f"has {self.run_facts.get(key)}; resume with the options of the run that saved it")
        if not self.accelerator.is_main_process:
            return
        if meta.get("world_size") != self.run_facts.get("world_size"):
            _warn(f"{folder} was saved by {meta.get('world_size')} ranks, this run has "
                  f"{self.run_facts.get('world_size')}: the global batch keeps each step's samples, so training "
                  "continues equivalently (equal within float tolerance, not bitwise)")
        changed = [f"{key} {meta[key]} -> {self.run_facts[key]}" for key in HYPERPARAMETERS
                   if key in meta and key in self.run_facts and meta[key] != self.run_facts[key]]
        if changed:
            _warn(f"{folder} was saved with other hyperparameters ({', '.join(changed)}): this run's values are in "
                  f"force from step {meta['step']} on (the schedule continues at that step), and config.yaml "
                  "records them")
        for key, why in (("seed", "the data order"), ("total_steps", "the learning-rate schedule")):
            if key in meta and meta[key] != self.run_facts.get(key):
                _warn(f"{folder} was saved with {key} {meta[key]}, this run has {self.run_facts.get(key)}: "
                      f"{why} after the resume differs from the original run's")

    def _load_weights_hook(self, models, input_dir) -> None:
        for i, model in enumerate(models):
            name = WEIGHTS_NAME if i == 0 else WEIGHTS_NAME.replace(".", f"_{i}.")
            load_weights(self.accelerator.unwrap_model(model, keep_torch_compile=False),
                         os.path.join(input_dir, name), source="--resume_from_checkpoint")
        models.clear()  # loaded: Accelerate would expect DDP's "module." keys

    def _on_main_then_all(self, fn: Callable[[], Any]) -> Any:
        return main_process_decides(self.accelerator, fn)  # one reader of the file system


def _fresh_folder(path: str) -> None:
    """An empty folder at ``path``: whatever a crashed save of the same step left there goes first."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    os.makedirs(path)


def _warn(message: str) -> None:
    print(f"accel_ddp: warning: {message}", file=sys.stderr, flush=True)
