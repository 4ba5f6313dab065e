"""Which checkpoint a resume loads: ``auto``'s newest trusted one, or a named folder once it passes every check.

    choice = CheckpointChoice(store, run_facts, staging)
    folder, local, meta = choice.choose("auto")    # None: auto found nothing; a ConfigError line: refused

``auto`` passes over damaged checkpoints (a warning each) and those a safe unpickler refused (``unsafe``); a named
one is refused when damaged, past this run's last step, another run's while this folder holds one, or older than an
intact newer one this run would overwrite. The loading itself is ``CheckpointManager.resume``'s (``manager.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from accel_ddp.checkpoint.manifest import CorruptCheckpoint, checkpoint_name, read_checkpoint
from accel_ddp.checkpoint.storage import LocalStore, ObjectStore
from accel_ddp.outputs.names import CHECKPOINTS_DIR, MARKER_NAME, SUMMARY_NAME
from accel_ddp.util.messages import say, warn
from accel_ddp.util.validation import ConfigError


@dataclass
class CheckpointChoice:
    """The checks of a resume's choice, on ``store`` (``run_facts``: this run's, its ``total_steps`` the last step;
    ``staging``: ``OUTPUT_DIR/checkpoints``)."""

    store: LocalStore | ObjectStore
    run_facts: dict[str, Any]
    staging: str

    def choose(self, spec: str, unsafe: list[str] = ()) -> tuple[str, str, dict[str, Any]] | None:
        """``(folder, local copy, checkpoint.json)`` of the checkpoint to resume, or None (auto, nothing saved);
        ``unsafe``: folders ``auto`` passed over already (their load was refused)."""
        if spec == "auto":
            candidates = self.store.sealed()
            for folder in self.store.unsealed() if not unsafe else ():  # an interrupted upload (said once)
                warn(f"ignoring {folder}: it has no {MARKER_NAME}, so its save never finished")
            if not candidates:
                say(f"no checkpoint in {self.store.root}; starting from scratch")
                return None
            for _, folder in reversed(candidates):
                if folder in unsafe:
                    continue
                try:
                    local, meta = self._verified(folder)
                except CorruptCheckpoint as err:
                    warn(f"skipping a damaged checkpoint: {err}; falling back to the previous one")
                    continue
                self._check_within_run(folder, meta)
                return folder, local, meta
            raise ConfigError(f"--resume_from_checkpoint auto: all {len(candidates)} checkpoints in {self.store.root} "
                              "are damaged or unsafe (see the warnings above); move them away to start from scratch")
        if self.store.remote and self.store.is_own(spec):
            try:
                local, meta = self._verified(spec)
            except CorruptCheckpoint as err:
                raise ConfigError(f"--resume_from_checkpoint {spec}: {err}; resume from an older checkpoint, or use "
                                  "auto, which skips damaged ones") from None
            self._check_within_run(spec, meta)
            self._refuse_to_overwrite_newer(spec, meta["step"])
            return spec, local, meta
        if not os.path.isdir(spec):
            raise ConfigError(f"--resume_from_checkpoint {spec}: no such folder; give a checkpoint folder "
                              f"(e.g. {os.path.join(self.store.root, checkpoint_name(100))}) or auto")
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
        return spec, spec, meta

    def _verified(self, folder: str) -> tuple[str, dict[str, Any]]:
        """The checkpoint's local copy (the folder itself on disk) and its checkpoint.json, once it proves whole;
        a CorruptCheckpoint names the store's object, not the downloaded copy."""
        local = self.store.local_copy(folder)
        try:
            return local, read_checkpoint(local)
        except CorruptCheckpoint as err:
            if local == folder:
                raise
            raise CorruptCheckpoint(str(err).replace(local, folder)) from None

    def _refuse_to_mix_runs(self, spec: str) -> None:
        """Branching off another run's checkpoint goes into a folder of its own: this folder's checkpoints,
        metrics and final outputs would otherwise be rewound, mixed with that run's, pruned or overwritten."""
        if self.store.is_own(spec):
            return  # one of this folder's own checkpoints
        output_dir = os.path.dirname(self.staging)
        held = [f"{CHECKPOINTS_DIR}/"] if self.store.sealed() else []
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
        for newer_step, folder in self.store.sealed():
            if newer_step <= step:
                continue
            try:
                self._verified(folder)
            except CorruptCheckpoint:
                continue  # damaged: auto would skip it too; it is set aside, not deleted, if this run reaches it
            raise ConfigError(f"--resume_from_checkpoint {spec}: {self.store.root} holds a newer checkpoint, "
                              f"{os.path.basename(folder)}, that this run would overwrite; continue from the newest "
                              "with auto, or give this run another --output_dir")
