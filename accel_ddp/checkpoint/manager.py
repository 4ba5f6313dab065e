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
gather of each rank's outcome; the main process hashes and fsyncs every file, writes
``checkpoint.json``, renames the folder into place (atomic on POSIX) and only then prunes
checkpoints beyond ``--keep_last``, never the one just written nor any newer one. A crash at any
point leaves every earlier checkpoint as it was; a write the file system refuses (a full disk) on
any rank is one line on every rank (``WriteFailed``), the ``.tmp-`` folder removed. A folder
already holding the step (a damaged one ``auto`` skipped) is renamed ``*.damaged``. Accelerate's
own ``total_limit`` rotation is not used: it deletes the oldest checkpoint before the new one is
written, and writes in place. With ``--checkpoint_dir URL`` the sealed checkpoints live in an object
store instead (``storage.py``): each save is staged in ``OUTPUT_DIR/checkpoints``, uploaded, then sealed.

Resuming (``CheckpointManager.resume``; which checkpoint: ``choice.py``): ``auto`` takes the newest folder that
``read_checkpoint`` trusts (``manifest.py``: files match ``checkpoint.json``, which lists every file the format needs;
its step is the folder's and the scheduler's; every rank's RNG file applies); a damaged one is
skipped with a warning, an explicit damaged path is exit 2. After ``load_state`` every rank checks
that its generators are those of its RNG file (Accelerate skips one it cannot apply without a word),
and the main process warns once if some are not. A checkpoint past the run's total step count, or an
explicit older one while intact newer ones exist, is refused: resuming would overwrite them. The
run's hyperparameters win over the checkpoint's (``flags_in_force``, with a warning). The training
position is the optimizer step alone: epochs have a fixed number of steps, so the loop recomputes
the epoch and fast-forwards the loader. Accelerate's ``load_state`` reads optimizer, scheduler,
scaler and RNG files through ``accelerate.utils.load``, i.e. ``torch.load(weights_only=True)`` with
NumPy's RNG types allow-listed; we never register custom objects (Accelerate unpickles those with
``weights_only=False``): the position lives in JSON. Signals and exit codes: ``preemption.py``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from accel_ddp.checkpoint.async_save import AsyncSaver, check_async_checkpointing
from accel_ddp.checkpoint.choice import CheckpointChoice
from accel_ddp.checkpoint.hyperparameters import HYPERPARAMETERS, check_compatible, flags_in_force  # noqa: F401
from accel_ddp.checkpoint.manifest import (  # noqa: F401 - CorruptCheckpoint, checkpoint_name, ...: this module's interface too
    STEP_DIR,
    CorruptCheckpoint,
    checkpoint_name,
    list_checkpoints,
    read_checkpoint,
    refused_pickle,
    rng_file,
    rng_not_restored,
    unsafe_file,
)
from accel_ddp.checkpoint.storage import DEFAULT_STORE_TIMEOUT, open_store
from accel_ddp.checkpoint.store_calls import StoreError, StoreFailed
from accel_ddp.checkpoint.train_state import TrainState
from accel_ddp.lifecycle.failure import main_process_decides
from accel_ddp.outputs.files import (
    READ_ONLY,
    WRITABLE_FIX,
    WriteFailed,
    fingerprint,
    relative_files,
    write_failure,
)
from accel_ddp.outputs.names import CHECKPOINTS_DIR
from accel_ddp.util.atomic import follow_umask
from accel_ddp.util.messages import first_line, say, warn
from accel_ddp.util.validation import ConfigError

FORMAT_VERSION = 1


class CheckpointManager:
    """Saves and restores the full training state of one run under ``OUTPUT_DIR/checkpoints``.

    ``save``, ``resume`` and ``check_fresh_start`` are collective: every rank calls them at the same
    point. ``run_facts`` (world size, global batch, steps per epoch, ...) go into every
    ``checkpoint.json`` and are compared on resume. ``state`` is what is saved and restored, as one
    (``train_state.py``); ``async_timeout`` (--async_checkpointing: seconds the sealing writer waits for the other
    ranks) writes each save in a background thread.

        >>> checkpoints = CheckpointManager(accelerator, "outputs/run", keep_last=3, run_facts=facts, state=state)
        >>> step = checkpoints.resume("auto")           # 0 when there is nothing to resume
        >>> checkpoints.save(step)                       # -> "outputs/run/checkpoints/step_00000100"
    """

    def __init__(self, accelerator: Accelerator, output_dir: str, keep_last: int, run_facts: dict[str, Any], *,
                 state: TrainState, checkpoint_dir: str | None = None, store_timeout: float = DEFAULT_STORE_TIMEOUT,
                 async_timeout: float | None = None):
        self.accelerator, self.state = accelerator, state
        self.staging = os.path.join(output_dir, CHECKPOINTS_DIR)  # where saves are written before their seal
        # --checkpoint_dir: sealed checkpoints go to an object store (storage.py); else they stay in staging
        self.store = open_store(checkpoint_dir or self.staging, self.staging, store_timeout)
        self.root = self.store.root
        self.keep_last = keep_last
        self.run_facts = dict(run_facts)
        self.choice = CheckpointChoice(self.store, self.run_facts, self.staging)  # which checkpoint a resume loads
        self.last_saved_step: int | None = None
        self.last_saved_folder: str | None = None  # the newest checkpoint this run saved or resumed from
        self.best = state.best  # its records go into checkpoint.json, its checkpoint is never pruned
        self._records: dict[str, Any] = {}  # the state's records at the last save step: its checkpoint.json's
        # --async_checkpointing: the state copied to host memory at the save step, written by a background thread
        self.saver: AsyncSaver | None = None
        if async_timeout is not None:
            check_async_checkpointing(accelerator)  # not for FSDP or DeepSpeed: their save is collective
            self.saver = AsyncSaver(self, state.model, state.optimizer, state.scheduler, async_timeout)
        # The weights (and a stream's positions) go through the state's hooks: see train_state.py.
        self._hooks = (accelerator.register_save_state_pre_hook(state.save_files),
                       accelerator.register_load_state_pre_hook(state.load_files))

    def remove_hooks(self) -> None:
        """At the run's end: the Accelerator lets go of the train state. Its hooks and the state's reference to the
        Accelerator form a cycle holding the DDP model, and with it the process group and gloo's threads, past
        ``train()``'s return into the interpreter's exit, where they abort it (tests/distributed/test_clean_exit.py)."""
        for hook in self._hooks:
            hook.remove()

    # ---- saving

    def save(self, step: int) -> str:
        """Save the full training state after optimizer ``step``; returns the checkpoint folder."""
        final = self.store.folder(step)
        if step in (self.last_saved_step, self.saver and self.saver.pending_step):  # e.g. preempted right after a
            return final  # scheduled save (sealed or in flight), or right after resuming
        acc = self.accelerator
        tmp = os.path.join(self.staging, f".tmp-{checkpoint_name(step)}")
        if self.saver is not None:  # --async_checkpointing: the previous save sealed, this one copied and started
            self.saver.wait()
            self._records = self.state.records()
            self._on_main_then_all(lambda: self._writing(step, tmp, lambda: _fresh_folder(tmp)))
            self.saver.save(step, tmp, final)  # last_saved_step and _folder follow once it is sealed (wait)
            return final
        # Each stage ends in a collective that carries its outcome: a write the file system refuses (a full disk)
        # on any rank stops every rank with one line, the unsealed folder removed and the earlier checkpoints as
        # they were. The main process's stages are its decisions; each rank writes its own RNG file.
        self._records = self.state.records()
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
            raise WriteFailed(self.cannot_save(step, problems[0]))
        self._on_main_then_all(lambda: self._writing(step, tmp, lambda: (self.seal(tmp, final, step),
                                                                         self.prune(keep=final))))
        self.last_saved_step, self.last_saved_folder = step, final
        return final

    def wait(self) -> None:
        """Collective: the save in flight (--async_checkpointing) sealed on every rank, or its WriteFailed."""
        if self.saver is not None:
            self.saver.wait()

    def failed_save(self, err: WriteFailed) -> WriteFailed:
        """``err`` (a write the file system refused on this process alone, e.g. a metrics line), or the failure of the
        save in flight that filled the disk first, its ``.tmp-`` folder removed (--async_checkpointing)."""
        why = self.saver.failed_here() if self.saver is not None else None
        if why is None:
            return err
        failed = WriteFailed(why)
        failed.only_this_rank = err.only_this_rank
        return failed

    def newest(self) -> tuple[int, str] | None:
        """(step, folder) of the newest checkpoint of this run, the one in flight included (a rollback to it waits
        for its seal in ``resume``), as a synchronous save would have it; None before any."""
        if self.saver is not None and self.saver.pending_step is not None:
            return self.saver.pending_step, self.store.folder(self.saver.pending_step)
        return None if self.last_saved_folder is None else (self.last_saved_step, self.last_saved_folder)

    def _writing(self, step: int, tmp: str, call: Callable[[], Any]) -> None:
        """``call()`` on the main process; a write the file system refuses removes ``tmp`` and is a WriteFailed
        (a store's refusal, a StoreError, is its own line)."""
        try:
            call()
        except (StoreError, StoreFailed):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as err:
            why = write_failure(err, tmp)
            if why is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise WriteFailed(self.cannot_save(step, why)) from err

    def cannot_save(self, step: int, why: str) -> str:
        """The one line of a save of ``step`` that failed for ``why`` (a write refused here, or on the async saver's
        thread): the fix, and the last checkpoint that is still intact."""
        intact = f" ({os.path.basename(self.last_saved_folder)}, the last checkpoint, is intact)" \
            if self.last_saved_folder else ""
        fix = WRITABLE_FIX if why.startswith(READ_ONLY) else \
            "free space there (a lower --keep_last keeps fewer checkpoints) or give another --output_dir"
        return f"cannot save the checkpoint of step {step} in {self.root}: {why}; {fix}, then resume with " \
               f"--resume_from_checkpoint auto{intact}"

    def seal(self, tmp: str, final: str, step: int) -> None:
        """Main process, once every rank wrote ``tmp``: its files' sizes and hashes into ``checkpoint.json``, written
        last, and the folder made ``final`` (the store's seal); the synchronous save's and the async saver's."""
        follow_umask(tmp)  # Accelerate's model.safetensors is 0600 (safetensors' own write), the rest follow the umask
        files = {name: fingerprint(os.path.join(tmp, name)) for name in relative_files(tmp)}
        steps_per_epoch = self.run_facts["steps_per_epoch"]
        meta = {"format": FORMAT_VERSION, "step": step, "epoch": step // steps_per_epoch,
                "step_in_epoch": step % steps_per_epoch, **self.run_facts,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files, **self._records}
        self.store.seal(tmp, final, meta)  # checkpoint.json last: on disk fsynced then renamed, in a store uploaded

    def prune(self, keep: str) -> None:
        """Delete all but the newest ``keep_last`` checkpoints up to ``keep`` (the one just saved).

        Newer ones are never ours to delete: they can only be damaged ones that ``auto`` skipped (a resume
        from an older step with intact newer checkpoints is refused), left for their owner to look at.
        """
        saved = int(STEP_DIR.match(os.path.basename(keep)).group(1))
        complete = [path for step, path in self.store.sealed() if step <= saved]
        best = self.store.folder(self.best.kept_step) if self.best and self.best.kept_step is not None else None
        for path in complete[: max(len(complete) - self.keep_last, 0)]:
            if path not in (keep, best):  # the best checkpoint is kept besides the newest keep_last
                self.store.remove(path)
        self.store.clean(up_to=saved)  # debris of saves or deletions a crash interrupted

    # ---- resuming

    def check_fresh_start(self) -> None:
        """Refuse to start from scratch over the checkpoints of an earlier run in the same folder."""
        def refuse_existing() -> None:
            existing = self.store.sealed()
            if existing:
                raise ConfigError(
                    f"{self.root} already holds checkpoints (newest {os.path.basename(existing[-1][1])}); "
                    "continue that run with --resume_from_checkpoint auto, or pick another "
                    f"{'--checkpoint_dir' if self.store.remote else '--output_dir'}")
        self._on_main_then_all(refuse_existing)

    def resume(self, spec: str) -> int:
        """Restore the state named by ``spec`` (``auto`` or a checkpoint folder) on every rank.

        Returns the optimizer step to continue after; 0 when ``auto`` found no checkpoint.
        """
        # A rollback (bad_steps/) while a save is in flight: its writer prunes, cleans the store's downloads and
        # seals a newer checkpoint; all of that is done before we choose, download and load.
        self.wait()
        unsafe: list[str] = []  # auto: checkpoints whose load a safe unpickler refused, passed over
        while True:
            choice = self._on_main_then_all(lambda: self.choice.choose(spec, unsafe))
            if choice is None:
                return 0
            folder, local, meta = choice  # local: the folder itself, or its copy downloaded from the store
            check_compatible(folder, meta, self.run_facts, self.accelerator.is_main_process)
            acc = self.accelerator
            own_rng = rng_file(local, acc.process_index)
            has_rng = os.path.isfile(own_rng)
            if self._loaded(spec, folder, local):
                break
            unsafe.append(folder)  # every rank alike: each read the same optimizer and scheduler files
        acc.step = 0  # checkpoints sit on optimizer-step boundaries: the accumulation counter restarts there
        # Before anything draws a random number: did load_state restore this rank's RNGs? It skips an RNG file it
        # cannot load or apply with an INFO log line only (huggingface/accelerate#4283).
        mine = rng_not_restored(own_rng) if has_rng else None
        self._say_if_not_exact(folder, meta, gather_object([(has_rng, mine)]))
        if acc.is_main_process:
            epoch = meta["step"] // self.run_facts["steps_per_epoch"]
            say(f"resumed from {folder} (optimizer step {meta['step']}, epoch {epoch})")
        self.last_saved_step, self.last_saved_folder = meta["step"], folder
        self.state.restore_records(meta)  # the best so far, the patience counter and the anomaly log continue
        return meta["step"]

    def _loaded(self, spec: str, folder: str, local: str) -> bool:
        """``load_state`` from ``local``; False where ``auto`` passes over a file a safe unpickler refuses (its
        state is then replaced by the next choice's load, whole: weights, optimizer, schedule, RNG)."""
        try:
            self.accelerator.load_state(local)
            return True
        except (ConfigError, torch.OutOfMemoryError):
            raise
        except Exception as err:  # torch.load or load_state_dict refused a file the manifest vouched for
            unsafe = unsafe_file(local) if isinstance(err, pickle.UnpicklingError) else None
            if unsafe is None:  # never torch's advice to load with weights_only=False: refused_pickle's words
                raise ConfigError(f"--resume_from_checkpoint {folder}: cannot load it ({type(err).__name__}: "
                                  f"{refused_pickle(err) or first_line(err)}); resume from another checkpoint") from err
            unsafe = unsafe.replace(local, folder)  # the store's object, not the downloaded copy
        if spec != "auto":
            raise ConfigError(f"--resume_from_checkpoint {folder}: {unsafe}; resume from another checkpoint, or use "
                              "auto, which passes over it") from None
        if self.accelerator.is_main_process:
            warn(f"skipping a checkpoint that does not load safely: {unsafe}; falling back to the previous one")
        return False

    def _say_if_not_exact(self, folder: str, meta: dict[str, Any], ranks: list[tuple[bool, list[str] | None]]) -> None:
        """One loud warning (main process) when some rank's random streams do not continue the checkpoint's.

        A warning, not a refusal: weights, optimizer, schedule and data position are restored exactly, only
        dropout and random augmentation on those ranks differ from the original run's; and a cause that is not
        damage (another Accelerate, the GPUs a rank sees) would refuse every checkpoint alike.
        """
        missing = [rank for rank, (has, _) in enumerate(ranks) if not has]
        differ = [f"rank {rank}'s {os.path.basename(rng_file(folder, rank))} ({', '.join(gens)})"
                  for rank, (has, gens) in enumerate(ranks) if has and gens]
        if not self.accelerator.is_main_process or not (missing or differ):
            return
        why = []
        if missing:
            why.append(f"it holds no RNG state for rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} "
                       f"(it was saved by {meta.get('world_size')} ranks): those keep their seeded RNG")
        if differ:
            why.append(f"load_state did not restore the generators of {'; '.join(differ)}")
        warn(f"the resume from {folder} is not exact: {'; '.join(why)}; random layers such as dropout and random "
              f"augmentation on those ranks differ from the original run's from step {meta['step']} on (weights, "
              "optimizer, schedule and data position are restored exactly)")

    def local_folder(self, step: int) -> str:
        """Collective: a local folder holding the checkpoint of ``step`` (downloaded from a store by the main
        process, into the staging folder every rank sees)."""
        return self._on_main_then_all(lambda: self.store.local_copy(self.store.folder(step)))

    def claim_store(self, output_dir: str) -> None:
        """Collective: --checkpoint_dir's prefix ours for the run (``release_store`` at its end), or one ConfigError
        line on every rank. Call it once ``output_dir`` is claimed: its lock is what lets a relaunch take over."""
        self._on_main_then_all(lambda: self.store.claim(output_dir))

    def release_store(self) -> None:
        if self.accelerator.is_main_process:
            self.store.release()

    def _on_main_then_all(self, fn: Callable[[], Any]) -> Any:
        return main_process_decides(self.accelerator, fn)  # one reader of the file system


def _fresh_folder(path: str) -> None:
    """An empty folder at ``path``: whatever a crashed save of the same step left there goes first."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    os.makedirs(path)
