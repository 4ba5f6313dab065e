"""Where sealed checkpoints live: a local folder, or an object store through fsspec, behind one interface.

    store = open_store("outputs/run/checkpoints")                           # LocalStore: os.rename, fsync
    store = open_store("s3://bucket/run", staging="outputs/run/checkpoints")  # ObjectStore: s3fs, gcsfs, adlfs
    store.seal(tmp, store.folder(20), meta)   # the files first, checkpoint.json last: only then is it trusted
    store.sealed()                            # [(20, "s3://bucket/run/step_00000020"), ...], oldest first
    local = store.local_copy(folder)          # a local folder to verify and load (the folder itself on disk)

Every save is written locally first, into the staging folder's ``.tmp-step_N`` (Accelerate's ``save_state``
writes local paths only; each rank its own files, as on disk). The local store seals it as it always has:
``checkpoint.json`` fsynced, then the folder renamed into place. The object store uploads every file, then
``checkpoint.json``: a checkpoint whose manifest is missing is unsealed, and one whose objects differ from it
is damaged; ``read_checkpoint`` on the downloaded copy tells both apart, exactly as on disk. A resume
downloads the checkpoint into ``STAGING/.fetched/step_N`` (the main process; the staging folder is in
``--output_dir``, which every rank sees) and loads it from there.

One run per prefix: ``ObjectStore.claim`` writes ``PREFIX/.lock``, naming this run and holding the random id
that ``OUTPUT_DIR/.store-claim`` keeps, after an explicit look for one (``exists``) and with a conditional
write where the store has one (fsspec ``pipe_file(mode="create")``: s3fs 2026.9 sends ``If-None-Match: *`` on
PutObject, s3fs/core.py ``_pipe_file``; the local file system opens it ``xb``; adlfs's ``_pipe_file`` drops
``mode`` and overwrites). A kill -9 leaves the lock behind; a relaunch takes it over only when the lock's id is
the one in its own output folder: that folder's ``.lock``, held by ``claim_output_dir`` before this, proves the
old holder dead (a host name and a path prove nothing: two containers can share both). Where the store ignores
the conditional write, a later run can still overwrite the lock; so every seal and every deletion first checks
that the lock object still holds our bytes, and the run stops with one line where it does not. Only the main
process calls any of this.

No call waits forever: ``store_calls.py`` bounds each call of an object store (``--store_timeout``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from accel_ddp.checkpoint.manifest import STEP_DIR, checkpoint_name, list_checkpoints
from accel_ddp.checkpoint.store_calls import DEFAULT_STORE_TIMEOUT, BoundedCalls, StoreError, fs_options
from accel_ddp.config import STORE_PACKAGES, URL_SCHEME
from accel_ddp.outputs.files import (
    READ_ONLY,
    READ_ONLY_ERRNOS,
    WRITABLE_FIX,
    WriteFailed,
    fsync_dir,
    relative_files,
    remove_dir,
    set_aside,
    write_failure,
)
from accel_ddp.outputs.names import LOCK_NAME, MARKER_NAME, STORE_CLAIM_NAME
from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.messages import first_line, say, warn
from accel_ddp.util.validation import ConfigError

FETCHED_DIR = ".fetched"  # under the staging folder: checkpoints downloaded from the store to be verified and loaded


def open_store(root: str, staging: str | None = None,
               timeout: float = DEFAULT_STORE_TIMEOUT) -> LocalStore | ObjectStore:
    """The store for ``root``: a local folder, or a URL (``--checkpoint_dir``) staged through ``staging``, each call
    bounded by ``timeout`` seconds (``--store_timeout``)."""
    return ObjectStore(root, staging, timeout) if URL_SCHEME.match(root) else LocalStore(root)


def check_store(root: str) -> None:
    """Open the store for ``root`` once, to refuse one that cannot even be opened (no account, bad settings) with its
    one line before any data is read; the run opens its own later (``CheckpointManager``)."""
    open_store(root)


class LocalStore:
    """Checkpoints as folders on a local or shared file system: renamed into place, fsynced (the fast path)."""

    remote = False

    def __init__(self, root: str):
        self.root = self.staging = root

    def folder(self, step: int) -> str:
        return os.path.join(self.root, checkpoint_name(step))

    def sealed(self) -> list[tuple[int, str]]:
        return list_checkpoints(self.root)

    def seal(self, tmp: str, final: str, meta: dict[str, Any]) -> None:
        with open(os.path.join(tmp, MARKER_NAME), "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(final):  # a damaged checkpoint of this step, which auto skipped: kept, under another name
            aside = set_aside(final)
            warn(f"{final} was damaged; moved it to {aside} and saved step {meta['step']} in its place")
        os.rename(tmp, final)
        fsync_dir(self.root)

    def unsealed(self) -> list[str]:
        """Nothing to report: an interrupted save is a ``.tmp-`` folder, never a ``step_`` one."""
        return []

    def remove(self, folder: str) -> None:
        remove_dir(folder)

    def clean(self, up_to: int) -> None:
        """Debris of saves or deletions a crash interrupted."""
        for name in os.listdir(self.root):
            if name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def local_copy(self, folder: str) -> str:
        return folder

    def manifest(self, folder: str) -> bytes:
        """``folder``'s checkpoint.json as stored, unverified (OSError where there is none)."""
        with open(os.path.join(folder, MARKER_NAME), "rb") as fh:
            return fh.read()

    def is_own(self, spec: str) -> bool:
        return os.path.realpath(os.path.dirname(os.path.normpath(spec))) == os.path.realpath(self.root)

    def claim(self, output_dir: str) -> None:
        """Nothing to claim: the output folder's own lock covers OUTPUT_DIR/checkpoints."""

    def release(self) -> None:
        pass


class ObjectStore(BoundedCalls):
    """Checkpoints as objects under a URL prefix (``s3://bucket/run/step_N/...``), through fsspec."""

    remote = True

    def __init__(self, url: str, staging: str | None, timeout: float = DEFAULT_STORE_TIMEOUT):
        scheme = URL_SCHEME.match(url).group(1).lower()
        self.timeout = timeout
        self.stopping: Callable[[], bool] = lambda: False  # has a stop signal come? (set by the loop's setup)
        self._stalled = False  # a call ran past its bound: the lock is left alone at the end (a relaunch takes it)
        package, extra = STORE_PACKAGES.get(scheme, (scheme, scheme))
        try:
            import fsspec

            self.fs, self.path = fsspec.core.url_to_fs(url, **fs_options(scheme, timeout))
            if scheme == "s3":
                self.fs.retries = 1  # botocore retries (config_kwargs); s3fs's loop around it would multiply them
        except ImportError:  # config/checks.py found the package; an import that still fails is one line too
            raise ConfigError(f"--checkpoint_dir {url} needs the {package} package, which cannot be imported; "
                              f"pip install \"accel_ddp[{extra}]\"") from None
        except Exception as err:  # the file system's constructor: adlfs raises ValueError without an account
            raise StoreError(f"--checkpoint_dir {url}: cannot open the store ({type(err).__name__}: "
                             f"{first_line(err)}); check its credentials and settings") from None
        self.root = url.rstrip("/")
        self.path = self.path.rstrip("/")
        self.staging = staging or os.path.join("outputs", "staging")
        self._lock_data: bytes | None = None  # the lock object as we wrote it; set once claim succeeded

    def folder(self, step: int) -> str:
        return f"{self.root}/{checkpoint_name(step)}"

    def _key(self, folder: str) -> str:
        return self.path + folder[len(self.root):]

    def _steps(self) -> dict[int, bool]:
        """Every step with objects under the prefix -> whether its manifest is there (one recursive listing)."""
        found: dict[int, bool] = {}
        self.fs.invalidate_cache()  # s3fs caches listings: another process (the killed run) wrote since
        try:
            # no maxdepth: s3fs lists a whole prefix in one paginated request then, and walks it folder by folder
            # with one (s3fs/core.py _find)
            keys = self._call("list", "find", self.path, passes=FileNotFoundError)
        except FileNotFoundError:  # nothing under the prefix yet (a bucket that is missing fails the lock first)
            keys = []
        for key in keys:
            parts = key[len(self.path):].strip("/").split("/")
            match = STEP_DIR.match(parts[0]) if len(parts) >= 2 else None
            if match:
                step = int(match.group(1))
                found[step] = found.get(step, False) or parts[1:] == [MARKER_NAME]
        return found

    def sealed(self) -> list[tuple[int, str]]:
        return [(step, self.folder(step)) for step, has_marker in sorted(self._steps().items()) if has_marker]

    def unsealed(self) -> list[str]:
        """Prefixes holding objects but no manifest: saves a crash interrupted (or a manifest deleted)."""
        return [self.folder(step) for step, has_marker in sorted(self._steps().items()) if not has_marker]

    def seal(self, tmp: str, final: str, meta: dict[str, Any]) -> None:
        """Upload every file of ``tmp``, then ``checkpoint.json``: the manifest is the last object written."""
        self.check_claim()
        key = self._key(final)
        existing = self._steps().get(int(STEP_DIR.match(final.rsplit("/", 1)[1]).group(1)))
        if existing:  # sealed but damaged (auto skipped it): kept for its owner, under another name
            aside = f"{key}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
            for obj in self._call("list", "find", key):  # object by object: no rename in a store
                self._call("move", "copy", obj, aside + obj[len(key):])
            self.remove(final)
            aside_url = self.root + aside[len(self.path):]
            warn(f"{final} was damaged; moved it to {aside_url} and saved step {meta['step']} in its place")
        elif existing is False:  # unsealed objects of a save a crash interrupted
            self._call("delete", "rm", key, recursive=True)
        for name in relative_files(tmp):
            path = os.path.join(tmp, name)
            self._call("upload", "put_file", path, f"{key}/{name}", nbytes=os.path.getsize(path))
        body = json.dumps(meta, indent=2).encode()
        self._call("upload", "pipe_file", f"{key}/{MARKER_NAME}", body)
        shutil.rmtree(tmp, ignore_errors=True)

    def remove(self, folder: str) -> None:
        """The manifest first: a deletion a crash interrupts leaves an unsealed prefix, never a gutted sealed one."""
        self.check_claim()
        key = self._key(folder)
        try:
            self._call("delete", "rm_file", f"{key}/{MARKER_NAME}", passes=FileNotFoundError)
        except FileNotFoundError:
            pass
        self._call("delete", "rm", key, recursive=True)

    def clean(self, up_to: int) -> None:
        """Unsealed prefixes up to the step just sealed (a crash's partial uploads) and the local staging debris."""
        self.check_claim()
        for step, has_marker in self._steps().items():
            if not has_marker and step <= up_to:
                self._call("delete", "rm", self._key(self.folder(step)), recursive=True)
        if os.path.isdir(self.staging):
            for name in os.listdir(self.staging):
                if name.startswith((".tmp-", ".trash-", FETCHED_DIR)):
                    shutil.rmtree(os.path.join(self.staging, name), ignore_errors=True)

    def local_copy(self, folder: str) -> str:
        """Download ``folder`` into ``STAGING/.fetched/step_N`` (replacing an earlier copy); that folder."""
        key, name = self._key(folder), folder.rsplit("/", 1)[1]
        dest = os.path.join(self.staging, FETCHED_DIR, name)
        shutil.rmtree(dest, ignore_errors=True)
        for obj, size in self._call("list", "find", key, detail=True).items():
            path = os.path.join(dest, *obj[len(key):].strip("/").split("/"))
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._call("download", "get_file", obj, path, passes=OSError, nbytes=size.get("size") or 0)
            except OSError as err:
                self._local_or_store(err, dest)
        os.makedirs(dest, exist_ok=True)  # no objects at all: an empty folder, which read_checkpoint calls unsealed
        return dest

    def manifest(self, folder: str) -> bytes:
        """``folder``'s checkpoint.json object, unverified, without downloading the checkpoint (OSError where
        there is none: fsspec's cat_file raises FileNotFoundError; a folder off the store is read from disk)."""
        if not self.is_own(folder):
            return LocalStore.manifest(self, folder)
        self.fs.invalidate_cache()
        return self._call("read", "cat_file", f"{self._key(folder.rstrip('/'))}/{MARKER_NAME}", passes=OSError)

    def is_own(self, spec: str) -> bool:
        head, _, name = spec.rstrip("/").rpartition("/")
        return head == self.root and bool(STEP_DIR.match(name))

    def claim(self, output_dir: str) -> None:
        """Write ``PREFIX/.lock`` naming this run, or take over a dead one's; another run's: one line, exit 2."""
        lock = f"{self.path}/{LOCK_NAME}"
        owner = {"host": socket.gethostname(), "output_dir": os.path.abspath(output_dir), "pid": os.getpid(),
                 "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "id": _folder_id(output_dir)}
        data = json.dumps(owner).encode()
        held = self._owner(lock)  # looked for first: the only check where a store ignores the conditional write
        if held:
            self._take_over(held, owner)
            self._call("lock", "pipe_file", lock, data)
        else:
            try:
                self._call("lock", "pipe_file", lock, data, mode="create", passes=FileExistsError)
            except FileExistsError:  # another run wrote it since we looked
                self._take_over(self._owner(lock), owner)
                self._call("lock", "pipe_file", lock, data)
        if self._owner(lock) != owner:  # a store that ignored mode="create" and a racing run that wrote last
            raise StoreError(f"--checkpoint_dir {self.root}: another run wrote {self.root}/{LOCK_NAME} at the same "
                             "time; give each run its own --checkpoint_dir")
        self._lock_data = data  # from now on a failure of the store is no longer bad settings (exit 1, StoreFailed)

    def _take_over(self, held: dict[str, Any], owner: dict[str, Any]) -> None:
        """Refuse ``held`` unless it names this very output folder (its id), whose lock we hold: its run is gone."""
        if not held.get("id") or held.get("id") != owner["id"]:
            raise StoreError(
                f"--checkpoint_dir {self.root} is in use by another run (its lock object {self.root}/{LOCK_NAME} says: "
                f"host {held.get('host')}, --output_dir {held.get('output_dir')}, pid {held.get('pid')}, since "
                f"{held.get('since')}); wait for that run to end, or, if it is dead, delete {self.root}/{LOCK_NAME} "
                "and relaunch")
        say(f"taking over {self.root}/{LOCK_NAME}, left by pid {held.get('pid')} on host {held.get('host')} (since "
            f"{held.get('since')}), which no longer holds {owner['output_dir']}")

    def check_claim(self) -> None:
        """Before a seal or a deletion: the lock object still holds our bytes, or StoreError (another run wrote it:
        a store without the conditional create; this run stops rather than prune that run's checkpoints)."""
        if self._lock_data is None:
            return
        lock = f"{self.path}/{LOCK_NAME}"
        try:
            now = self._call("lock check", "cat_file", lock, passes=FileNotFoundError)
        except FileNotFoundError:
            now = None
        if now != self._lock_data:
            held = _parsed(now)
            who = (f"host {held.get('host')}, --output_dir {held.get('output_dir')}, pid {held.get('pid')}"
                   if held else "it is gone")
            raise StoreError(f"--checkpoint_dir {self.root}: this run lost its lock {self.root}/{LOCK_NAME} ({who}): "
                             "another run is using the prefix, so this one stops without saving or deleting "
                             "anything more; give each run its own --checkpoint_dir")

    def release(self) -> None:
        """Delete the lock object, if it is still ours (the run ends, however it ends short of a kill)."""
        lock = f"{self.path}/{LOCK_NAME}"
        if self._lock_data is None:
            return
        self._lock_data, data = None, self._lock_data
        if self._stalled:  # another call would wait as long: the next run from this output folder takes it over
            warn(f"left the lock object {self.root}/{LOCK_NAME} behind (the store stopped answering); a relaunch "
                 "with the same --output_dir takes it over")
            return
        try:
            if self._call("lock check", "cat_file", lock) == data:
                self._call("delete", "rm_file", lock)
        except Exception as err:  # noqa: BLE001 - the run's outcome stands; the next claimant is told how to clear it
            warn(f"could not delete the lock object {self.root}/{LOCK_NAME} ({first_line(err)}); delete it before "
                 "another run uses this --checkpoint_dir")

    def _owner(self, lock: str) -> dict[str, Any]:
        """The lock object's owner; {} where there is none. ``exists`` first: s3fs's cat_file of a missing key
        raises FileNotFoundError too, but a store's wrapper may not."""
        if not self._call("lock", "exists", lock):
            return {}
        try:
            return _parsed(self._call("lock", "cat_file", lock, passes=FileNotFoundError)) or \
                {"host": "?", "output_dir": "?", "pid": "?", "since": "? (an unreadable lock object)"}
        except FileNotFoundError:
            return {}

    def _local_or_store(self, err: OSError, dest: str) -> None:
        """A download that failed: this machine's disk (full, read-only) is named as such, the rest is the store's."""
        if err.errno in (errno.ENOSPC, errno.EDQUOT, *READ_ONLY_ERRNOS):
            why = write_failure(err, dest)
            fix = WRITABLE_FIX if why.startswith(READ_ONLY) else \
                "free space there (room for one checkpoint) or give another --output_dir"
            raise WriteFailed(f"cannot download {self.root}'s checkpoint into {dest}: {why}; {fix}") from None
        raise self._failed("download", err) from None


def _folder_id(output_dir: str) -> str:
    """``OUTPUT_DIR/.store-claim``'s random id, written the first time: what proves a lock object names this folder."""
    path = os.path.join(output_dir, STORE_CLAIM_NAME)
    try:
        with open(path, encoding="utf-8") as fh:
            found = fh.read().strip()
        if found:
            return found
    except FileNotFoundError:
        pass
    made = uuid.uuid4().hex
    atomic_write_text(path, made + "\n")
    return made


def _parsed(data: bytes | None) -> dict[str, Any]:
    try:
        held = json.loads(data) if data else None
    except ValueError:
        return {}
    return held if isinstance(held, dict) else {}
