"""bf16 autocast on a CPU: one verdict, said alike by ``accel-ddp doctor`` and the run's start-up block.

    >>> cpu_bf16_verdict(False)[:38]
    'this CPU has no bf16 units (no AMX/AVX'

No torch: the doctor and the start-up block read the CPU's flags, not a benchmark.
"""

from __future__ import annotations


def read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return fh.read()
    except OSError:  # not Linux: assume no bf16 units, the cautious answer
        return ""


def cpu_has_bf16_units(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's flags list AMX-BF16 or AVX512-BF16 (Sapphire Rapids, Cooper Lake, Zen 4 and later)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return bool(flags & {"amx_bf16", "avx512_bf16"})
    return False


def cpu_bf16_verdict(has_units: bool) -> str:
    """What bf16 autocast on this CPU is likely to do. With bf16 units it depends on the model (1.3-1.6x faster for
    the MNIST CNNs on an AMX Xeon core; slower for small MLPs, where the casts cost more than the matmuls save), so
    neither side says "keep it": both say measure."""
    if has_units:
        return ("this CPU has bf16 units (AMX/AVX512-BF16): autocast may beat fp32 for large matmuls and convolutions "
                "(1.3-1.6x for the MNIST CNNs on an AMX Xeon core) and lose to it for small models")
    return "this CPU has no bf16 units (no AMX/AVX512-BF16): autocast emulates bf16 and is usually slower than fp32"
