"""The packed token blocks of ``--task causal_lm --packing``, cached between runs (``--text_cache``).

    ~/.cache/accel_ddp/text_blocks/<key>/train.npy, eval.npy, manifest.json

A second run over the same data skips reading the texts, tokenizing and packing: it loads two int64
arrays. The key is a sha256 over everything the blocks depend on, so a changed input is a new entry,
never a stale read:

- the data files under ``--data_dir`` (each file's relative path, byte count and modification time
  in ns: an edit, a copy over it or a new file changes it; the bytes are not hashed, which would cost
  as much as reading them; datasets' own ``cache-*.arrow`` and lock files left out);
- the tokenizer's content (a fast tokenizer's full JSON, vocabulary, merges, normalizer and special
  tokens; a slow one's vocabulary and special tokens), whatever folder or Hub name it came from;
- the packing settings (``--max_length``, ``--text_column``, the splits, the held-out tenth, the
  tokenizing batch) and :data:`CACHE_VERSION` (bumped whenever the packing code changes its output).

Hub datasets (``--hf_name``) are not cached: their files live in the datasets cache, whose revisions
this key cannot see. An entry is written into a temporary folder and renamed into place (atomic), by
one process per machine (the loop builds the data there first: ``local_main_first``); the manifest
holds each array's byte count and sha256, checked on every read, so a damaged entry is rebuilt with
one line, never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import torch

from accel_ddp.outputs.files import file_sha256, relative_files, remove_dir
from accel_ddp.util.messages import note

CACHE_VERSION = 1  # bump when the tokenizing or packing code changes the blocks it makes
SPLITS = ("train", "eval")
MANIFEST = "manifest.json"


def cache_root(flag: str | None) -> str | None:
    """The cache folder of ``--text_cache``: None for 'off'; unset, ``$ACCEL_DDP_CACHE/text_blocks`` (the test
    suite points it at a temporary folder) or ``~/.cache/accel_ddp/text_blocks``."""
    if flag == "off":
        return None
    if flag is None:
        flag = os.path.join(os.environ.get("ACCEL_DDP_CACHE") or "~/.cache/accel_ddp", "text_blocks")
    return os.path.expanduser(flag)


def data_files_key(data_dir: str) -> list[list[Any]]:
    """[relative path, bytes, mtime_ns] for the file ``data_dir`` or every file under it, sorted."""
    if os.path.isfile(data_dir):
        stat = os.stat(data_dir)
        return [[os.path.basename(data_dir), stat.st_size, stat.st_mtime_ns]]
    rows = []
    for name in relative_files(data_dir):
        if _datasets_own(os.path.basename(name)):
            continue
        stat = os.stat(os.path.join(data_dir, name))
        rows.append([name, stat.st_size, stat.st_mtime_ns])
    return rows


def _datasets_own(name: str) -> bool:
    """A file datasets writes beside a ``save_to_disk`` folder's data (``map``'s ``cache-*.arrow``, locks): not
    data, and written by the first build, so keying on it would make every first hit a miss."""
    return (name.startswith("cache-") and name.endswith(".arrow")) or name.endswith(".lock")


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 of what decides a tokenizer's ids: a fast tokenizer's serialised form, else its vocabulary."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {"eos_token_id": tokenizer.eos_token_id, "special_tokens": getattr(tokenizer, "special_tokens_map", {}),
                "length": len(tokenizer)}
    digest.update(json.dumps(specials, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(data_dir: str, tokenizer: Any, settings: dict[str, Any]) -> str:
    """The entry's name: sha256 over the data files, the tokenizer and the packing ``settings``."""
    parts = {"version": CACHE_VERSION, "files": data_files_key(data_dir), "tokenizer": tokenizer_digest(tokenizer),
             "settings": settings}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def entry_dir(cache_dir: str, key: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), key)


def has_entry(cache_dir: str, key: str) -> bool:
    return os.path.isfile(os.path.join(entry_dir(cache_dir, key), MANIFEST))


def read_blocks(cache_dir: str, key: str) -> tuple[torch.Tensor, ...] | None:
    """The cached (train, eval) blocks, or None: no entry, or a damaged one (one line; the caller rebuilds it)."""
    folder = entry_dir(cache_dir, key)
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest_path):
        return None
    problem = _damage(folder, manifest_path)
    if problem is None:
        try:
            return tuple(torch.from_numpy(np.load(os.path.join(folder, f"{split}.npy"), allow_pickle=False))
                         for split in SPLITS)
        except (OSError, ValueError) as err:
            problem = f"unreadable ({type(err).__name__})"
    note(f"--text_cache: the cached blocks {folder} are damaged ({problem}); rebuilding them from the data",
         ranks="first")
    return None


def _damage(folder: str, manifest_path: str) -> str | None:
    """What is wrong with an entry (a missing file, another byte count or digest than its manifest's), or None."""
    try:
        with open(manifest_path) as fh:
            files = json.load(fh)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its manifest does not parse"
    for split in SPLITS:
        path, want = os.path.join(folder, f"{split}.npy"), files.get(split) if isinstance(files, dict) else None
        if want is None or not os.path.isfile(path):
            return f"{split}.npy is missing"
        if os.path.getsize(path) != want.get("bytes"):
            return f"{split}.npy holds {os.path.getsize(path)} bytes, its manifest {want.get('bytes')}"
        if file_sha256(path) != want.get("sha256"):
            return f"{split}.npy does not match its manifest's sha256"
    return None


def write_blocks(cache_dir: str, key: str, blocks: tuple[torch.Tensor, ...], about: dict[str, Any]) -> None:
    """Write an entry into a temporary folder beside it, then rename it into place: readers see all or nothing.

    A damaged entry in the way is removed first; an entry another process renamed into place meanwhile wins.
    A cache that cannot be written (read-only, full) costs the next run its speed only: one line, no error."""
    folder = entry_dir(cache_dir, key)
    parent = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=parent)
        try:
            files = {}
            for split, tensor in zip(SPLITS, blocks, strict=True):
                path = os.path.join(tmp, f"{split}.npy")
                np.save(path, tensor.numpy(), allow_pickle=False)
                files[split] = {"bytes": os.path.getsize(path), "sha256": file_sha256(path, fsync=True),
                                "shape": list(tensor.shape)}
            with open(os.path.join(tmp, MANIFEST), "w") as fh:  # last: an entry without it is no entry
                json.dump({"files": files, "about": about}, fh, indent=1, sort_keys=True, default=str)
            if os.path.exists(folder):  # damaged (read_blocks said so): out of the way
                remove_dir(folder)
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:
        if not os.path.isfile(os.path.join(folder, MANIFEST)):  # not another process's entry in place
            note(f"--text_cache: could not write {folder} ({err.strerror or err}); the next run tokenizes again; "
                 "free space there, or give another folder with --text_cache (or 'off')", ranks="first")
