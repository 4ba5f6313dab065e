"""The packed token blocks of ``--task causal_lm --packing``, cached between runs (``--text_cache``).

    ~/.cache/accel_ddp/text_blocks/<key>/train.npy, eval.npy, manifest.json

A second run over the same data skips reading the texts, tokenizing and packing: it loads two int64
arrays. The key is a sha256 over everything the blocks depend on, so a changed input is a new entry,
never a stale read:

- the data files under ``--data_dir`` (each file's relative path, byte count and modification time
  in ns: an edit, a copy over it or a new file changes it; the bytes are not hashed, which would cost
  as much as reading them; datasets' own ``cache-*.arrow`` and lock files left out);
- the tokenizer: from a local folder, the bytes of every file there that can decide its ids
  (:func:`tokenizer_files_digest`: tokenizer.json, vocab.*, merges.txt, *.model, the configs and
  special-token maps) and the installed Transformers, tokenizers and sentencepiece versions, read
  without loading it (importing the tokenizer classes and loading took ~2 s of a hit's data phase on
  the 2-core machine); from a Hub name, the loaded tokenizer's content (a fast tokenizer's full JSON,
  a slow one's vocabulary, and the special tokens);
- the packing settings (``--max_length``, ``--text_column``, the splits, the held-out tenth, the
  tokenizing batch) and :data:`CACHE_VERSION` (bumped whenever the packing code changes its output).

Hub datasets (``--hf_name``) are not cached: their files live in the datasets cache, whose revisions
this key cannot see. An entry is written into a temporary folder and renamed into place (atomic), by
one process per machine (the loop builds the data there first: ``local_main_first``); the manifest
holds each array's byte count and sha256, checked on every read, so a damaged entry is rebuilt with
one line, never read. It also holds what the rest of start-up reads from the tokenizer (its length and
special token ids, :func:`tokenizer_facts`), so a hit on a tokenizer folder loads no tokenizer at all
(``text.CachedTokenizer`` loads it on first use of anything else: saving it beside the final model).
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from typing import Any, NamedTuple

import numpy as np
import torch

from accel_ddp.outputs.files import (
    READ_ONLY_ERRNOS,
    file_sha256,
    free_bytes,
    human_size,
    relative_files,
    remove_dir,
    write_failure,
)
from accel_ddp.util.atomic import follow_umask
from accel_ddp.util.messages import first_line, note

CACHE_VERSION = 2  # bump when the tokenizing or packing code changes the blocks it makes, or the key changes form
SPLITS = ("train", "eval")
MANIFEST = "manifest.json"
# The files of a tokenizer folder that AutoTokenizer.from_pretrained reads (config.json: the model type, where
# tokenizer_config.json names no class); anything else there (weights) cannot change the ids.
TOKENIZER_FILE_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                           "vocab.*", "merges.txt", "*.model", "*.tiktoken", "config.json")
ID_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.*", "merges.txt", "*.model", "*.tiktoken")
TOKENIZER_PACKAGES = ("transformers", "tokenizers", "sentencepiece")
FACTS = ("length", "pad_token_id", "eos_token_id", "bos_token_id")  # what start-up reads from the tokenizer
ENTRY_OVERHEAD = 64 * 1024  # bytes of an entry beyond its arrays: two .npy headers, the manifest, the folder
FULL_NUMPY = re.compile(r"\d+ requested and \d+ written")  # numpy's write error (ndarray.tofile) on a full disk


class Entry(NamedTuple):
    """A cache entry read back: the (train, eval) blocks and its manifest's ``about``."""

    blocks: tuple[torch.Tensor, ...]
    about: dict[str, Any]


def cache_root(flag: str | None) -> str | None:
    """The cache folder of ``--text_cache``: None for 'off'; unset, ``$ACCEL_DDP_CACHE/text_blocks`` (the test
    suite points it at a temporary folder) or ``~/.cache/accel_ddp/text_blocks``."""
    if flag == "off":
        return None
    given = flag is not None
    if flag is None:
        flag = os.path.join(os.environ.get("ACCEL_DDP_CACHE") or "~/.cache/accel_ddp", "text_blocks")
    folder = os.path.expanduser(flag)
    if os.path.exists(folder) and not os.path.isdir(folder):  # every rank finds it alike: the first one says so
        named = f"--text_cache {flag}" if given else f"the text cache {folder}"
        note(f"{named} is a file, not a folder: the packed blocks are not cached in this run (the file is left as "
             "it is); give a folder (created if missing) with --text_cache, or 'off'", ranks="first")
        return None
    return folder


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


def tokenizer_files_digest(name: str | None) -> str | None:
    """sha256 of a local tokenizer folder's id-deciding files (names and bytes) and the tokenizer packages' versions,
    or None: not a folder, or none of the files that make a tokenizer there (the loaded tokenizer decides, or says
    what is wrong). Reads a few small files; imports nothing."""
    if name is None or not os.path.isdir(name):
        return None
    names = sorted(entry for entry in os.listdir(name) if os.path.isfile(os.path.join(name, entry))
                   and any(fnmatch.fnmatch(entry, pattern) for pattern in TOKENIZER_FILE_PATTERNS))
    if not any(fnmatch.fnmatch(entry, pattern) for entry in names for pattern in ID_FILES):
        return None
    digest = hashlib.sha256(json.dumps([_version(package) for package in TOKENIZER_PACKAGES]).encode())
    for entry in names:
        digest.update(f"\0{entry}\0".encode())
        digest.update(file_sha256(os.path.join(name, entry)).encode())
    return digest.hexdigest()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def tokenizer_facts(tokenizer: Any) -> dict[str, int | None]:
    """What the start-up after the data reads from the tokenizer (the model's vocabulary size and special token ids,
    the pad id), kept in the manifest so that a hit need not load it."""
    return {"length": len(tokenizer), **{name: getattr(tokenizer, name, None) for name in FACTS[1:]}}


def cache_key(data_dir: str, tokenizer: str, settings: dict[str, Any]) -> str:
    """The entry's name: sha256 over the data files, the tokenizer (:func:`tokenizer_files_digest` or
    :func:`tokenizer_digest`) and the packing ``settings``."""
    parts = {"version": CACHE_VERSION, "files": data_files_key(data_dir), "tokenizer": tokenizer,
             "settings": settings}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def entry_dir(cache_dir: str, key: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), key)


def has_entry(cache_dir: str, key: str) -> bool:
    return os.path.isfile(os.path.join(entry_dir(cache_dir, key), MANIFEST))


def read_blocks(cache_dir: str, key: str) -> Entry | None:
    """The cached (train, eval) blocks and the manifest's ``about``, or None: no entry, or a damaged one (one line;
    the caller rebuilds it)."""
    folder = entry_dir(cache_dir, key)
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest_path):
        return None
    problem, about = _damage(folder, manifest_path)
    if problem is None:
        try:
            return Entry(tuple(torch.from_numpy(np.load(os.path.join(folder, f"{split}.npy"), allow_pickle=False))
                               for split in SPLITS), about)
        except (OSError, ValueError) as err:
            problem = f"unreadable ({type(err).__name__})"
    note(f"--text_cache: the cached blocks {folder} are damaged ({problem}); rebuilding them from the data",
         ranks="first")
    return None


def _damage(folder: str, manifest_path: str) -> tuple[str | None, dict[str, Any]]:
    """(what is wrong with an entry: a missing file, another byte count or digest than its manifest's, or None;
    the manifest's ``about``)."""
    try:
        with open(manifest_path) as fh:
            manifest = json.load(fh)
        files, about = manifest["files"], manifest.get("about")
        if not isinstance(about, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "its manifest does not parse", {}
    for split in SPLITS:
        path, want = os.path.join(folder, f"{split}.npy"), files.get(split) if isinstance(files, dict) else None
        if want is None or not os.path.isfile(path):
            return f"{split}.npy is missing", about
        if os.path.getsize(path) != want.get("bytes"):
            return f"{split}.npy holds {os.path.getsize(path)} bytes, its manifest {want.get('bytes')}", about
        if file_sha256(path) != want.get("sha256"):
            return f"{split}.npy does not match its manifest's sha256", about
    return None, about


def write_blocks(cache_dir: str, key: str, blocks: tuple[torch.Tensor, ...], about: dict[str, Any]) -> None:
    """Write an entry into a temporary folder beside it, then rename it into place: readers see all or nothing.

    A damaged entry in the way is removed first; an entry another process renamed into place meanwhile wins.
    A cache that cannot be written (read-only, full) costs the next run its speed only: one line saying which
    (a full disk in sizes: what the entry needs, what is free; an entry larger than the free space is not started),
    no error. Called by one process per machine (``TextOptions.cache_write``)."""
    folder = entry_dir(cache_dir, key)
    parent = os.path.dirname(folder)
    needed = sum(t.numel() * t.element_size() for t in blocks) + ENTRY_OVERHEAD
    try:
        if free_bytes(parent) < needed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=parent)
        try:
            _write_entry(tmp, folder, blocks, about)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:
        if not os.path.isfile(os.path.join(folder, MANIFEST)):  # not another process's entry in place
            why, fix = _write_refused(err, parent, needed)
            note(f"--text_cache: could not write {folder}: {why}; the next run tokenizes again; "
                 f"{fix + ', or g' if fix else 'g'}ive another folder with --text_cache (or 'off')", ranks="first")


def _write_entry(tmp: str, folder: str, blocks: tuple[torch.Tensor, ...], about: dict[str, Any]) -> None:
    files = {}
    for split, tensor in zip(SPLITS, blocks, strict=True):
        path = os.path.join(tmp, f"{split}.npy")
        np.save(path, tensor.numpy(), allow_pickle=False)
        files[split] = {"bytes": os.path.getsize(path), "sha256": file_sha256(path, fsync=True),
                        "shape": list(tensor.shape)}
    with open(os.path.join(tmp, MANIFEST), "w") as fh:  # last: an entry without it is no entry
        json.dump({"files": files, "about": about}, fh, indent=1, sort_keys=True, default=str)
    follow_umask(tmp)  # mkdtemp's folder is 0700: a shared cache must be readable as the umask says
    if os.path.exists(folder):  # damaged (read_blocks said so): out of the way
        remove_dir(folder)
    os.rename(tmp, folder)


def _write_refused(err: OSError, parent: str, needed: int) -> tuple[str, str]:
    """(why an entry could not be written, the fix) in words: a full disk in sizes (numpy's own error on a full disk
    is "N requested and M written", with no errno), a read-only folder as read-only, a path through a file as such."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT) or FULL_NUMPY.search(str(err)):
        return (f"the disk is full (needs {human_size(needed)}, {human_size(free_bytes(parent))} free)",
                "free space there")
    if err.errno in (errno.ENOTDIR, errno.EEXIST):
        return f"a part of that path is a file, not a folder ({err.strerror})", ""
    return write_failure(err, parent) or first_line(err), "make it writable" if err.errno in READ_ONLY_ERRNOS else ""
