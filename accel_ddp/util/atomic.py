"""The one crash-safe write every layer needs (the run's files, torchelastic's error file of a failing rank), and the
modes of what other writers leave.

    atomic_write_text("outputs/run/summary.json", text)   # readers see the old file or the new, never half
    follow_umask("outputs/run/hf_model.tmp")             # 0644/0755 under umask 022, whoever wrote the files
"""

from __future__ import annotations

import os


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place: a reader sees the old file or the new."""
    tmp = f"{path}.tmp{os.getpid()}"  # one per writer
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a write that failed (a full disk) leaves no half file behind
            os.remove(tmp)


def current_umask() -> int:
    """This process's umask: from /proc (Linux 4.7+), else set and restored (another thread could create a file
    with umask 0 in between: only where /proc does not say)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the modes an ``open()``/``mkdir`` of this process
    gives: 0666 (0777 for folders and executables) less the umask.

    For what other writers create owner-only: safetensors writes through a temporary file, 0600 whatever the umask
    (safetensors 0.8), and ``tempfile.mkdtemp`` makes 0700 folders; teammates on a shared file system could not
    read the weights. A file this process may not chmod (another user's) is left as it is.
    """
    mask = current_umask()
    if not os.path.isdir(path):
        _chmod(path, 0o666, mask)
        return
    for parent, _, files in os.walk(path):  # every folder is a parent once
        _chmod(parent, 0o777, mask)
        for name in files:
            _chmod(os.path.join(parent, name), 0o666, mask)


def _chmod(path: str, full: int, mask: int) -> None:
    try:
        executable = 0o111 if os.stat(path).st_mode & 0o100 else 0  # a file that was executable stays so
        os.chmod(path, (full | executable) & ~mask)
    except OSError:
        pass
