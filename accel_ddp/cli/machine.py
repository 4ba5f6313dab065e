"""What this machine offers a run: GPUs, NCCL, bf16 support, CPU cores, MPI; and the software versions.

    facts = MachineFacts.detect()   # asks torch; tests build one by hand
    software_versions()             # {"python": ..., "torch": "2.x (built with CUDA 12.x, NCCL 2.x)", ...}

``accel-ddp doctor`` checks a launch config against these facts and prints them at the top of its report.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass

from accel_ddp.util.cpu_bf16 import cpu_has_bf16_units, read_cpuinfo  # noqa: F401 - cpu_has_bf16_units: tests, doctor


@dataclass(frozen=True)
class MachineFacts:
    """What this machine offers. ``detect()`` asks torch; tests build one by hand.

        >>> MachineFacts(gpu_count=8, nccl_available=True, bf16_supported=False)  # 8 V100s
    """

    gpu_count: int = 0            # CUDA devices visible to this process (honours CUDA_VISIBLE_DEVICES)
    nccl_available: bool = False  # torch was built with NCCL (needed for multi-GPU all-reduce)
    bf16_supported: bool = True   # every visible GPU is Ampere (compute capability 8.0) or newer; CPUs: True
    cpu_count: int = 1            # cores this process may run on
    mpirun_available: bool = False
    gpu_name: str = ""
    cpu_bf16: bool = False        # the CPU has bf16 matrix units (AMX-BF16 or AVX512-BF16): fast bf16 autocast
    unusable_gpus: int = 0        # GPUs the NVIDIA driver lists but this torch cannot use (e.g. a driver too old)
    cuda_problem: str = ""        # why, as CUDA says it
    torch_version: str = ""
    cuda_build: str = ""          # torch.version.cuda: the CUDA this torch was built with; "" for a CPU-only build
    nvidia_driver: bool = False   # an NVIDIA driver is loaded (/dev/nvidiactl): GPUs exist, maybe hidden
    cuda_libraries_bytes: int = 0  # torch and its CUDA packages on disk (measured only where no GPU can use them)

    @classmethod
    def detect(cls) -> MachineFacts:
        import torch

        from accel_ddp.data import usable_cpus
        from accel_ddp.distributed.preflight import unusable_gpus

        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        unusable, problem = unusable_gpus()
        driver = os.path.exists("/dev/nvidiactl")
        idle_cuda = bool(torch.version.cuda) and not gpu_count and not unusable and not driver
        capabilities = [torch.cuda.get_device_capability(i) for i in range(gpu_count)]
        nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
        return cls(
            gpu_count=gpu_count,
            nccl_available=bool(nccl),
            bf16_supported=all(cap >= (8, 0) for cap in capabilities),
            cpu_count=usable_cpus(),
            mpirun_available=shutil.which("mpirun") is not None or shutil.which("mpiexec") is not None,
            gpu_name=torch.cuda.get_device_name(0) if gpu_count else "",
            cpu_bf16=cpu_has_bf16_units(read_cpuinfo()),
            unusable_gpus=unusable,
            cuda_problem=problem,
            torch_version=torch.__version__,
            cuda_build=torch.version.cuda or "",
            nvidia_driver=driver,
            cuda_libraries_bytes=cuda_libraries_bytes() if idle_cuda else 0,
        )

    def describe(self) -> str:
        gpus = f"{self.gpu_count} GPU(s)" + (f" ({self.gpu_name})" if self.gpu_name else "")
        if self.unusable_gpus:
            gpus += f" ({self.unusable_gpus} listed by the driver that this torch cannot use)"
        nccl = "" if not self.gpu_count else ", NCCL" if self.nccl_available else ", no NCCL"
        return f"{gpus}{nccl}, {self.cpu_count} CPU core(s)" + (" with bf16 units" if self.cpu_bf16 else "")


def cuda_libraries_bytes() -> int:
    """Bytes on disk of torch and the CUDA packages PyPI's torch pulls in (nvidia-*, cuda-*, triton), as pip
    installed them (each distribution's RECORD)."""
    from importlib.metadata import distributions

    total = 0
    for dist in distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-")):
            for file in dist.files or ():
                try:
                    total += file.locate().stat().st_size
                except OSError:
                    pass
    return total


def software_versions() -> dict[str, str]:
    """What ``accelerate env`` reports, for one line: Python, platform, torch with its CUDA and NCCL, libraries."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    versions = {"python": platform.python_version(), "platform": platform.platform()}
    if torch.version.cuda:
        build = f"built with CUDA {torch.version.cuda}"
        if torch.distributed.is_available() and torch.distributed.is_nccl_available():
            build += ", NCCL " + ".".join(map(str, torch.cuda.nccl.version()))
    else:
        build = "CPU-only build"
    versions["torch"] = f"{torch.__version__} ({build})"
    for name in ("accelerate", "datasets", "transformers"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    from accel_ddp import __version__  # the code running, which may be a clone rather than what pip installed

    versions["accel_ddp"] = __version__
    return versions
