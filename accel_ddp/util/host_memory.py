"""Keep the host memory a CPU training step frees for the next step, instead of handing it back to the kernel.

A training step allocates and frees the same large tensors every time (activations, logits, their gradients:
8-17 MiB each for the tiny GPT-2 of docs/tasks.md). glibc serves them from mmap or from the top of its heap, and
gives the heap's top back to the kernel (``brk``) whenever more than ``M_TRIM_THRESHOLD`` of it is free. Both
thresholds move by themselves (each freed mmapped chunk raises them, up to 32 and 64 MiB), so whether a step's
memory is reused or faulted in again, page by page, depends on what the process happened to free before. Measured
on the causal-LM workload of benchmarks/tax.py (one rank, strace and ``ru_minflt``): the heap grew and shrank by
~60 MiB every step, 7,100 page faults in each forward, 2,000-3,000 in each backward, while the hand-written loop
of benchmarks/bare_ddp.py, same model and batch, happened to fault none in its forward.

:func:`keep_freed_host_memory` pins both thresholds: allocations up to 32 MiB (glibc's own ceiling for the moving
threshold) come from the heap, and up to 256 MiB of free heap top stays mapped for reuse. Larger allocations are
mmapped and returned at once, as before. The cost is that a process keeps up to 256 MiB it no longer uses after
its largest step. Called by every training rank on the CPU; on a GPU the step's tensors live in CUDA's caching
allocator and the host does not churn.

Left alone where someone chose otherwise: a ``MALLOC_*_`` threshold or a ``glibc.malloc`` tunable in the
environment, another allocator preloaded (jemalloc, tcmalloc, mimalloc), or a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2); the moving threshold stops here too
TRIM_THRESHOLD = 256 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def why_left_alone(env=os.environ) -> str | None:
    """Why this process's allocator is not ours to tune, or None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    if any(name in env for name in USER_SETTINGS) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "set in the environment"
    if any(name in env.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS):
        return "another allocator is preloaded"
    return None


def keep_freed_host_memory(env=os.environ) -> str:
    """Pin glibc's mmap and trim thresholds for this process (see the module docstring); returns what was done:
    ``"pinned"`` or why it was left alone."""
    if reason := why_left_alone(env):
        return reason
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "not glibc"
    # mallopt returns 1 on success. The mmap threshold first: setting either one stops both from moving.
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "refused by glibc"
    return "pinned"
