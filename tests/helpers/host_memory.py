"""A step's worth of host allocations, freed and made again: the page faults each repetition costs.

    faults_per_step()    # [faults of step 1, step 2, ...]: ~PAGES each while glibc gives the memory back

Plain ``malloc``/``free`` through ctypes (no torch, no Accelerate): a fresh interpreter runs it in a fraction
of a second.
"""

from __future__ import annotations

import ctypes
import platform
import resource

from accel_ddp.util.host_memory import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD

BLOCKS, BLOCK_BYTES = 10, 8 << 20  # 80 MiB a step: over the 64 MiB glibc trims at however far its threshold moved
PAGES = BLOCKS * BLOCK_BYTES // resource.getpagesize()
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def faults_per_step(steps: int = 5) -> list[int]:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    faults = []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(BLOCK_BYTES) for _ in range(BLOCKS)]
        for block in blocks:
            ctypes.memset(block, 1, BLOCK_BYTES)  # touched, as a tensor's fill or a kernel's output would
        for block in blocks:
            libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


def give_freed_memory_back() -> None:
    """glibc's default thresholds (128 KiB), held there: whatever this process inherited, freed blocks go back."""
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 128 << 10) == 1
