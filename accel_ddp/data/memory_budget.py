"""How much data a rank may hold in memory: the budget ``--loader auto`` and the Hugging Face decode stay within.

    limit = in_memory_limit(accelerator, configured_mb=4096)   # collective: the same on every rank
    limit.decode_mb   # a Hugging Face training set decoded larger than this stays memory-mapped
    limit.device_mb   # an in-memory training set larger than this takes the DataLoader, not the device loader
    limit.note("the decoded training set", nbytes, limit.decode_mb)   # the one line that says why, or None

Host memory: what the machine has available now (``MemAvailable``), clamped to the cgroup limit of
this process and its ancestors (``psutil.virtual_memory`` is not cgroup-aware: giampaolo/psutil#2100;
the ComfyUI and vLLM fixes read ``/proc/self/cgroup`` the same way), divided among the machine's
ranks (``LOCAL_WORLD_SIZE``: every local rank decodes its own copy at the same time), and halved
for the decode's working memory (a rank's peak resident set is about twice the decoded size).
Device memory (CUDA): a quarter of what is free on this rank's device when the data is chosen,
before the model, optimizer and activations arrive (``torch.cuda.mem_get_info``, device-wide, plus
this process's cached-but-unused blocks). The figures differ between ranks, so they agree on the
smallest (one all-reduce at start-up), and every rank takes the same path.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

from accel_ddp.util.messages import note
from accel_ddp.util.ranks import local_world_size

DECODE_WORKING_FACTOR = 2  # peak resident set / decoded size while decoding (issue 25: "about twice")
DEVICE_SHARE = 0.25  # of the device memory free at start-up: the model, optimizer and activations need the rest
CGROUP_NO_LIMIT = 2**62  # cgroup v1 writes 0x7ffffffffffff000 for "no limit"; anything this large is none


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _stat(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def cgroup_available_bytes(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Memory this process's cgroups still allow (limit - usage + reclaimable page cache), the smallest over the
    cgroup and its ancestors, v2 or v1; None where no limit is set or visible."""
    best = None
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # v2: memory.max, memory.current, inactive_file
            files, base = ("memory.max", "memory.current", "inactive_file"), root
        elif "memory" in controllers.split(","):  # v1
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            base = os.path.join(root, "memory")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the limit may sit on a parent
            folder = os.path.join(base, *parts[:depth])
            limit = _read(os.path.join(folder, files[0]))
            if limit is None or not limit.isdigit() or int(limit) >= CGROUP_NO_LIMIT:
                continue
            usage = int(_read(os.path.join(folder, files[1])) or 0)
            reclaimable = _stat(_read(os.path.join(folder, "memory.stat")), files[2])
            free = max(int(limit) - usage + reclaimable, 0)
            best = free if best is None else min(best, free)
    return best


def host_available_bytes() -> int | None:
    """This machine's available memory for this process: ``MemAvailable``, clamped to the cgroup limit; None
    where neither can be read (then no host budget applies)."""
    available = _stat((_read("/proc/meminfo") or "").replace(":", "").replace(" kB", ""), "MemAvailable")
    available = available * 1024 if available else None
    if available is None:
        try:
            import psutil

            available = int(psutil.virtual_memory().available)
        except Exception:  # noqa: BLE001 - psutil missing: no figure rather than a guess
            available = None
    limit = cgroup_available_bytes()
    return limit if available is None else available if limit is None else min(available, limit)


def device_available_bytes(device) -> int | None:
    """CUDA: memory free on ``device`` (device-wide) plus this process's cached-but-unused blocks; None elsewhere."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)  # on this rank's device: device 0 would get a context per rank
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class InMemoryLimit(NamedTuple):
    """The agreed limits, in MiB (``math.inf``: none), and how the budget was found."""

    configured_mb: float  # --device_loader_max_mb
    decode_mb: float  # the Hugging Face in-memory decode: min(configured, host and device budget)
    device_mb: float  # the device loader: min(configured, device budget); host data is already in memory
    how: str  # the budget's arithmetic, for the line that says why

    def note(self, what: str, nbytes: int, limit_mb: float, instead: str = "reading it memory-mapped") -> str | None:
        """The note to print when ``nbytes`` is over ``limit_mb`` because of the machine's budget (not the flag)."""
        if nbytes <= limit_mb * 2**20 or nbytes > self.configured_mb * 2**20:
            return None
        return (f"{what} would take {nbytes / 2**20:.3g} MiB per rank, over this machine's "
                f"budget of {limit_mb:.3g} MiB ({self.how}), which --device_loader_max_mb {self.configured_mb:g} "
                f"does not raise: {instead}")


def budget_mb(device, ranks: int) -> tuple[float, float]:
    """(host budget, device budget) of one rank, in MiB (inf: unknown, no limit)."""
    host, dev = host_available_bytes(), device_available_bytes(device)
    host_mb = math.inf if host is None else host / 2**20 / ranks / DECODE_WORKING_FACTOR
    dev_mb = math.inf if dev is None else dev / 2**20 * DEVICE_SHARE
    return host_mb, dev_mb


def _how(host_mb: float, dev_mb: float, ranks: int, world: int) -> str:
    how = [] if math.isinf(host_mb) else [f"host memory available, cgroup-aware, / {ranks} local ranks / "
                                          f"{DECODE_WORKING_FACTOR} for the decode's working copy"]
    how += [] if math.isinf(dev_mb) else [f"{DEVICE_SHARE:g} of the device memory free"]
    return " and ".join(how) + (", the smallest over the ranks" if world > 1 else "") if how else "no figure"


def in_memory_limit(accelerator, configured_mb: float) -> InMemoryLimit:
    """The limits every rank agrees on (collective: one MIN all-reduce over the ranks' budgets)."""
    import torch

    ranks = local_world_size(default=accelerator.num_processes)
    host_mb, dev_mb = budget_mb(accelerator.device, ranks)
    if accelerator.num_processes > 1:
        mine = torch.tensor([min(host_mb, 2.0**60), min(dev_mb, 2.0**60)], dtype=torch.float64,
                            device=accelerator.device)
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MIN)
        host_mb, dev_mb = (math.inf if v >= 2.0**60 else v for v in mine.tolist())
    return InMemoryLimit(configured_mb, min(configured_mb, host_mb, dev_mb), min(configured_mb, dev_mb),
                         _how(host_mb, dev_mb, ranks, accelerator.num_processes))


def say(message: str | None) -> None:
    """``message`` as a note from the main process (every rank decides the same; one line per run)."""
    if message:
        note(message, ranks="main")
