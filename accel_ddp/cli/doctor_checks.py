"""The checks ``accel-ddp doctor`` runs on a launch config (after its launch flags), each adding findings to the
report: the single-process traps, several machines, GPUs, mixed precision, the rendezvous address and port.

``read_launch`` reads what the config asks for once (numbers checked as it goes); every check then gets the config,
the machine's facts and that reading, and adds its findings in the order the report prints them.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from accel_ddp.cli.doctor_report import ERROR, NOTE, WARNING, Report
from accel_ddp.cli.machine import MachineFacts
from accel_ddp.config import MIXED_PRECISIONS
from accel_ddp.util.cpu_bf16 import cpu_bf16_verdict

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")  # RFC 1123 host name
_TESTED_TYPES = ("NO", "MULTI_GPU", "FSDP", "MULTI_CPU")


@dataclass(frozen=True)
class Launch:
    """What the launch config (with its overrides) asks for, read once (``read_launch``) for every check."""

    dist: str
    mixed: str
    num_processes: int
    num_machines: int
    machine_rank: int
    port: int | None
    gpu_ids: list[int] | None
    launcher_starts_many: bool  # torchrun starts num_processes (MULTI_GPU, FSDP, not --cpu)
    per_machine: int


def read_launch(report: Report, config: dict[str, Any], cpu: bool) -> Launch:
    """What ``config`` asks for; a finding for each number that is unreadable or out of range (then a default)."""
    dist = str(config.get("distributed_type", "NO"))
    mixed = str(config.get("mixed_precision") or "no").lower()
    num_processes = _as_int(report, config, "num_processes")
    num_machines = _as_int(report, config, "num_machines")
    machine_rank = _as_int(report, config, "machine_rank")
    num_machines = 1 if num_machines is None else num_machines
    machine_rank = 0 if machine_rank is None else machine_rank
    if num_machines < 1:
        report.add(ERROR, f"num_machines is {num_machines}", "set num_machines: 1 or more")
        num_machines = 1
    port = _as_int(report, config, "main_process_port")
    gpu_ids = _parse_gpu_ids(report, config.get("gpu_ids"))
    if num_processes is None or num_processes == -1:
        report.add(ERROR, "num_processes is not set; `accelerate launch` stops with 'manually pass --num_processes'",
                   "set num_processes: to the total number of processes over all machines")
        num_processes = 1
    return Launch(dist, mixed, num_processes, num_machines, machine_rank, port, gpu_ids,
                  launcher_starts_many=dist in ("MULTI_GPU", "FSDP") and not cpu,
                  per_machine=num_processes // num_machines)


def run_checks(report: Report, config: dict[str, Any], facts: MachineFacts, launch: Launch, cpu: bool,
               is_port_in_use) -> None:
    for check in (_check_traps, _check_machines, _check_gpus, _check_precision, _check_rendezvous):
        check(report, config, facts, launch, cpu, is_port_in_use)
    _check_torch_build(report, facts)


# torch's CPU-only wheels (https://pytorch.org/get-started/locally/): PyPI has only the CUDA build for Linux x86-64.
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _check_torch_build(report: Report, facts: MachineFacts) -> None:
    """A CUDA build of torch where no GPU exists (no NVIDIA driver): gigabytes that training on the CPU never uses."""
    if not facts.cuda_build or facts.gpu_count or facts.unusable_gpus or facts.nvidia_driver:
        return
    size = f"take {facts.cuda_libraries_bytes / 1e9:.1f} GB here" if facts.cuda_libraries_bytes else "take gigabytes"
    report.add(WARNING, f"torch {facts.torch_version} is a CUDA build (CUDA {facts.cuda_build}) on a machine without "
               f"a GPU: it and its CUDA libraries (nvidia-*, triton) {size}, which training on the CPU never uses",
               f"a CPU-only torch needs none of them: pip uninstall torch, then {CPU_TORCH} (README's Install)")


def _check_traps(report: Report, config: dict[str, Any], facts: MachineFacts, launch: Launch, cpu: bool,
                is_port_in_use=None) -> None:
    """The silent single-process traps: the launcher starts 1 process whatever num_processes says."""
    dist, num_processes = launch.dist, launch.num_processes
    if num_processes > 1:
        if cpu:
            report.add(ERROR, f"--cpu makes `accelerate launch` take its simple path: 1 process, not {num_processes}",
                       "drop --cpu; with distributed_type MULTI_GPU accel_ddp trains on CPU over gloo by itself")
        elif dist == "MULTI_CPU" and not (config.get("mpirun_config") or {}).get("mpirun_hostfile"):
            report.add(ERROR, f"distributed_type MULTI_CPU without mpirun starts 1 process, not {num_processes}",
                       "use distributed_type: MULTI_GPU (torchrun starts the processes, accel_ddp forms a gloo group "
                       "on CPU), as in accelerate_configs/cpu_2proc.yaml")
        elif dist == "MULTI_CPU" and not facts.mpirun_available:
            report.add(ERROR, "mpirun_config names a hostfile but neither mpirun nor mpiexec is on PATH",
                       "install an MPI, or use distributed_type: MULTI_GPU (see accelerate_configs/cpu_2proc.yaml)")
        elif dist == "NO":
            report.add(ERROR, f"distributed_type NO starts 1 process, not {num_processes}",
                       "use distributed_type: MULTI_GPU for several processes, or num_processes: 1")
    if dist not in _TESTED_TYPES:
        report.add(WARNING, f"distributed_type {dist} is not one accel_ddp is tested with",
                   "use MULTI_GPU (DDP), FSDP or NO; see accelerate_configs/README.md")
    if dist == "MULTI_GPU" and config.get("use_cpu") and facts.gpu_count:
        report.add(WARNING, "use_cpu: true is ignored by MULTI_GPU launches: training will use the GPUs",
                   "remove use_cpu, or launch with CUDA_VISIBLE_DEVICES='' to train on CPU")


def _check_machines(report: Report, config: dict[str, Any], facts: MachineFacts, launch: Launch, cpu: bool,
                is_port_in_use=None) -> None:
    """num_processes is the total over all machines; each machine has its own rank."""
    num_processes, num_machines, machine_rank = launch.num_processes, launch.num_machines, launch.machine_rank
    launcher_starts_many, per_machine = launch.launcher_starts_many, launch.per_machine
    if not 0 <= machine_rank < num_machines:
        report.add(ERROR, f"machine_rank {machine_rank} is outside 0..{num_machines - 1}",
                   f"give each machine its own rank from 0 to {num_machines - 1} (--machine_rank on its launch line)")
    if num_machines > 1 and launcher_starts_many:
        if num_processes % num_machines:
            report.add(ERROR, f"num_processes {num_processes} does not split evenly over {num_machines} machines",
                       "num_processes is the total over all machines: machines x processes per machine")
        elif facts.gpu_count and per_machine < facts.gpu_count:
            report.add(ERROR, f"num_processes {num_processes} over {num_machines} machines is {per_machine} per "
                       f"machine, but this machine has {facts.gpu_count} GPUs",
                       f"num_processes is the total over all machines: set it to "
                       f"{num_machines * facts.gpu_count}")


def _check_gpus(report: Report, config: dict[str, Any], facts: MachineFacts, launch: Launch, cpu: bool,
                is_port_in_use=None) -> None:
    """GPUs this torch can use, gpu_ids, a process per GPU, NCCL."""
    dist, num_processes, num_machines = launch.dist, launch.num_processes, launch.num_machines
    gpu_ids, launcher_starts_many, per_machine = launch.gpu_ids, launch.launcher_starts_many, launch.per_machine
    if facts.unusable_gpus:
        report.add(ERROR, f"this machine has {facts.unusable_gpus} NVIDIA GPU(s) but this torch cannot use them "
                   f"({facts.cuda_problem or 'torch.cuda.is_available() is False'}); accel_ddp refuses to launch "
                   "rather than quietly train on the CPU",
                   "install the torch build that matches the driver (nvidia-smi shows its CUDA version; "
                   "https://pytorch.org/get-started/locally/) or update the driver; or launch with "
                   "CUDA_VISIBLE_DEVICES='' to train on the CPU on purpose")
    elif facts.gpu_count == 0:
        if dist == "FSDP" and not cpu:
            report.add(ERROR, "FSDP needs GPUs: on CPU Accelerate ignores it and each process trains a full "
                       "DDP replica (distributed type MULTI_CPU)",
                       "run this file on a GPU machine; here use accelerate_configs/cpu_2proc.yaml")
        elif launcher_starts_many and gpu_ids and num_processes > 1:
            report.add(ERROR, f"gpu_ids {config.get('gpu_ids')!r} asks for GPUs but this machine has none",
                       "run this file on a GPU machine, or use accelerate_configs/cpu_2proc.yaml here")
        elif launcher_starts_many:
            level = WARNING if per_machine > facts.cpu_count else NOTE
            report.add(level, f"no GPU here: the {per_machine} process(es) on this machine will train on CPU over "
                       f"gloo ({facts.cpu_count} core(s))",
                       "fine for a CPU run (accel_ddp asks Accelerate for CPU itself)"
                       + ("; use no more processes than cores" if level == WARNING else ""))
        elif num_processes <= 1:
            report.add(NOTE, "no GPU here: the single process trains on CPU", "fine for debugging on CPU")
    if facts.gpu_count:
        visible = len(gpu_ids) if gpu_ids else facts.gpu_count
        if gpu_ids and max(gpu_ids) >= facts.gpu_count:
            report.add(ERROR, f"gpu_ids {config.get('gpu_ids')!r} names a device this machine lacks "
                       f"(it has {facts.gpu_count}: 0..{facts.gpu_count - 1})",
                       "list only existing devices, or gpu_ids: all")
        if dist in ("MULTI_GPU", "FSDP") and gpu_ids is not None and len(gpu_ids) < 2 and num_machines <= 1:
            report.add(ERROR, "gpu_ids names fewer than two GPUs for a multi-GPU launch: `accelerate launch` "
                       "refuses it",
                       "list at least two devices, or gpu_ids: all, or distributed_type: 'NO' for one GPU")
        if launcher_starts_many and per_machine > visible:
            report.add(ERROR, f"{per_machine} process(es) on this machine but only {visible} GPU(s) for them: "
                       f"Accelerate puts rank r on GPU r % {visible}, so two ranks would share a GPU and NCCL stop at "
                       "the first collective ('Duplicate GPU detected'); accel_ddp refuses such a launch",
                       f"set num_processes: {visible * num_machines} (the total over all machines)")
        elif launcher_starts_many and num_machines == 1 and per_machine < visible:
            report.add(WARNING, f"{per_machine} process(es) for {visible} GPU(s): {visible - per_machine} stay idle",
                       f"set num_processes: {visible}, or list the GPUs to use in gpu_ids")
        if launcher_starts_many and num_processes > 1 and not facts.nccl_available:
            report.add(ERROR, "this torch has no NCCL: GPU processes cannot all-reduce",
                       "install a CUDA build of torch (pip install torch from the CUDA index)")


def _check_precision(report: Report, config: dict[str, Any], facts: MachineFacts, launch: Launch, cpu: bool,
                is_port_in_use=None) -> None:
    """mixed_precision against this machine's GPU or CPU."""
    mixed = launch.mixed
    if mixed not in MIXED_PRECISIONS:
        report.add(ERROR, f"mixed_precision {mixed!r} is unknown", "use no, bf16 or fp16")
    elif mixed == "bf16" and facts.gpu_count and not facts.bf16_supported:
        report.add(ERROR, f"mixed_precision bf16 but this GPU ({facts.gpu_name or 'pre-Ampere'}) has no bf16 support",
                   "use mixed_precision: fp16 (Accelerate adds a grad scaler) or no")
    elif mixed == "bf16" and not facts.gpu_count and facts.cpu_bf16:  # the run's start-up block says the same
        report.add(NOTE, f"mixed_precision bf16 on CPU: {cpu_bf16_verdict(True)}",
                   "compare with mixed_precision: 'no' once for your model, and keep the faster")
    elif mixed == "bf16" and not facts.gpu_count:
        report.add(WARNING, f"mixed_precision bf16 on CPU without bf16 units: {cpu_bf16_verdict(False)}",
                   "use mixed_precision: 'no' on this CPU (keep bf16 for the GPU run you compare against)")
    elif mixed == "fp16" and not facts.gpu_count:
        report.add(ERROR, "mixed_precision fp16 on CPU: Accelerate silently trains in fp32",
                   "use mixed_precision: 'no' (or bf16) on CPU")
    elif mixed == "fp8":
        report.add(WARNING, "mixed_precision fp8 needs Hopper GPUs and transformer_engine, MS-AMP or torchao",
                   "use bf16 unless you have set fp8 up")


def _check_rendezvous(report: Report, config: dict[str, Any], facts: MachineFacts, launch: Launch, cpu: bool,
                is_port_in_use=None) -> None:
    """The rendezvous address and port."""
    num_machines, machine_rank, port = launch.num_machines, launch.machine_rank, launch.port
    launcher_starts_many = launch.launcher_starts_many
    _check_host(report, config.get("main_process_ip"), num_machines)
    if port is not None and not 0 <= port <= 65535:
        report.add(ERROR, f"main_process_port {port} is not a TCP port", "pick one in 1024..65535, e.g. 29500")
    elif port == 0 and num_machines > 1:
        report.add(ERROR, "main_process_port 0 (pick a free one) cannot work over several machines: each would pick "
                   "its own", "set one fixed port, the same on every machine")
    elif port and launcher_starts_many and machine_rank == 0 and is_port_in_use(port):
        if num_machines > 1:
            report.add(ERROR, f"port {port} is already in use here, and machine 0 must listen on it",
                       "stop the job holding it, or pick another --main_process_port on every machine")
        else:
            report.add(WARNING, f"port {port} is already in use here (another job?); Accelerate will fall back to a "
                       "random free port", "pass --main_process_port with a free port, or 0 to always pick one")


def no_config_file(report: Report, facts: MachineFacts, cpu: bool) -> None:
    fix = ("run `accelerate config` (the answers for each setup are in docs/launch.md), or pass --config_file "
           "accelerate_configs/cpu_2proc.yaml (or 4gpu.yaml, ...)")
    if facts.gpu_count > 1 and not cpu:
        report.add(NOTE, f"no accelerate config: `accelerate launch` runs its defaults, one process per GPU "
                   f"({facts.gpu_count}, DDP) in fp32 on this machine only", f"{fix} for bf16 or several machines")
    else:
        report.add(WARNING, "no accelerate config: `accelerate launch` starts 1 process", fix + " for several")


def _as_int(report: Report, config: dict, key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        report.add(ERROR, f"{key} is {value!r}, not a whole number", f"set {key}: to an integer")
        return None


def _parse_gpu_ids(report: Report, gpu_ids: Any) -> list[int] | None:
    """None for 'all' / unset; the listed ids otherwise (an error finding when unreadable)."""
    if gpu_ids is None or gpu_ids == "all":
        return None
    if not isinstance(gpu_ids, str):
        report.add(ERROR, f"gpu_ids is the YAML number {gpu_ids!r}; `accelerate launch` needs a string",
                   f"quote it: gpu_ids: '{gpu_ids}' (or gpu_ids: all)")
        return None
    try:
        return [int(part) for part in gpu_ids.split(",") if part.strip()]
    except ValueError:
        report.add(ERROR, f"gpu_ids {gpu_ids!r} is not a comma-separated list of device numbers",
                   "write e.g. gpu_ids: '0,1,2,3' or gpu_ids: all")
        return None


def _check_host(report: Report, ip: Any, num_machines: int) -> None:
    if ip is None or ip == "":
        if num_machines > 1:
            report.add(ERROR, f"num_machines is {num_machines} but main_process_ip is not set",
                       "set main_process_ip: to machine 0's address, reachable from every machine")
        return
    text = str(ip)
    if "://" in text or "/" in text or (":" in text and not _is_ip(text)):
        report.add(ERROR, f"main_process_ip {text!r} is malformed (a URL, path or host:port)",
                   "give a bare address such as 10.0.0.1 or node001; the port goes in main_process_port")
        return
    if _is_ip(text):
        if num_machines > 1 and ipaddress.ip_address(text).is_loopback:
            report.add(WARNING, f"main_process_ip {text} is loopback: only processes on this host can reach it",
                       "use machine 0's network address, unless every 'machine' is this host")
        return
    if re.fullmatch(r"[0-9.]+", text) or not _HOSTNAME.fullmatch(text):
        report.add(ERROR, f"main_process_ip {text!r} is malformed: neither an IP address nor a host name",
                   "give a bare address such as 10.0.0.1 or node001")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False
