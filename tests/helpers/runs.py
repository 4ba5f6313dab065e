"""Runs as a user starts them (``launch``: `accelerate launch`, ``run_single``: `python train.py`), the same on
forked ranks (``train_ranks``, ``main_ranks``), and reading a run's files back.

Launches run over gloo on loopback, each on a free port, with the suite's environment (``suite_env``): one thread per
rank, offline, no GPU unless a GPU test passes ``gpu_env()``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from accel_ddp.outputs.names import MARKER_NAME
from tests.helpers.env import OFFERED_GPUS
from tests.helpers.multiproc import free_port, run_ranks

REPO = Path(__file__).resolve().parents[2]
CPU_2PROC = REPO / "accelerate_configs" / "cpu_2proc.yaml"
ACCELERATE_LAUNCH = ("-m", "accelerate.commands.launch")  # `accelerate launch`
ACCEL_DDP_LAUNCH = ("-m", "accel_ddp", "launch")  # `accel-ddp launch`: the same arguments (accel_ddp/cli/launch.py)
TRAIN_SCRIPT = REPO / "train.py"
SCRIPTS = REPO / "tests" / "scripts"
FAULTY_TRAIN = SCRIPTS / "faulty_train.py"  # train.py plus the FAULT_* injections of tests/helpers/faults.py


def suite_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Every subprocess's environment: this one's, one thread, offline, no GPU; ``extra`` on top (None: unset)."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1",  # two ranks on two cores: no thread oversubscription
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TQDM_DISABLE": "1",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",  # launches train on the CPU unless a GPU test passes gpu_env()
    })
    env.pop("ACCELERATE_USE_CPU", None)
    env.update(extra or {})
    return {name: value for name, value in env.items() if value is not None}  # None in extra: unset


def gpu_env(extra: dict[str, str] | None = None) -> dict[str, str | None]:
    """``env`` for ``launch``/``run_single`` that gives a GPU test the machine's GPUs back (None: unset)."""
    return {"CUDA_VISIBLE_DEVICES": OFFERED_GPUS, **(extra or {})}


@functools.cache
def gpu_count() -> int:
    """CUDA GPUs a subprocess with ``gpu_env()`` can use: 0 without an NVIDIA driver (checked without torch)."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    result = subprocess.run([sys.executable, "-c", probe], env=suite_env(gpu_env()), capture_output=True, text=True,
                            timeout=120)
    return int(result.stdout.strip() or 0) if result.returncode == 0 else 0


def _faulty_if_asked(script, env):
    if script == TRAIN_SCRIPT and any(name.startswith("FAULT_") for name in env or {}):
        return FAULTY_TRAIN
    return script


def launch(script_args: list[str], nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 240,
           script: str | os.PathLike = TRAIN_SCRIPT, launch_args: list[str] | None = None,
           cwd: str | os.PathLike | None = None,
           config_file: str | os.PathLike | None = CPU_2PROC,
           launcher: tuple[str, ...] = ACCELERATE_LAUNCH) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file cpu_2proc.yaml SCRIPT ARGS` as a user would type it.

    With FAULT_* variables in ``env`` the default script is tests/scripts/faulty_train.py, which reads them.
    ``config_file=None``: plain `accelerate launch SCRIPT ARGS`, which reads Accelerate's default config
    (give ``HF_HOME`` in ``env``); ``nproc`` and the free port are then the config's business.
    ``launcher=ACCEL_DDP_LAUNCH``: `accel-ddp launch` instead.
    """
    script = _faulty_if_asked(script, env)
    flags = [] if config_file is None else ["--config_file", str(config_file), "--num_processes", str(nproc),
                                           "--main_process_port", str(free_port())]
    cmd = [sys.executable, *launcher, *flags, *(launch_args or []), str(script), *script_args]
    return subprocess.run(cmd, env=suite_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO)


def launch_machines(script_args: list[str], num_processes: int, folder: Path,
                    timeout: float = 300) -> tuple[list[int], dict[int, str]]:
    """Two machines on loopback: `accelerate launch --config_file 2node_8gpu.yaml --num_machines 2` twice (machine 1
    first), ``num_processes`` in all; their exit codes (machine 0's first) and logs (``folder/machine<N>.log``)."""
    port, machines = free_port(), []
    for rank in (1, 0):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "accelerate_configs" / "2node_8gpu.yaml"), "--num_machines", "2", "--machine_rank",
               str(rank), "--num_processes", str(num_processes), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), "--mixed_precision", "no", str(TRAIN_SCRIPT), *script_args]
        with open(folder / f"machine{rank}.log", "w") as out:  # files, not pipes: a full pipe would block a rank
            machines.append(subprocess.Popen(cmd, env=suite_env(), stdout=out, stderr=subprocess.STDOUT, text=True,
                                             cwd=REPO))
    try:
        codes = [proc.wait(timeout=timeout) for proc in reversed(machines)]
    finally:
        for proc in machines:
            if proc.poll() is None:
                proc.kill()
    return codes, {rank: (folder / f"machine{rank}.log").read_text() for rank in (0, 1)}


def launch_together(*launches: dict) -> list[subprocess.CompletedProcess]:
    """``launch(**kwargs)`` for each dict, all at once (each gets its own free port): independent launches
    that a test compares keep both cores busy while each launcher and its workers start up."""
    with ThreadPoolExecutor(len(launches)) as pool:
        return list(pool.map(lambda kwargs: launch(**kwargs), launches))


def launcher_env(launch_args: list[str]) -> dict[str, str]:
    """What `accelerate launch LAUNCH_ARGS script.py` adds to its torchrun workers' environment, without a launch.

    Accelerate's own code computes it, as the launcher does: its argument parser, the config file
    (``_validate_launch_command``) and ``prepare_multi_gpu_env``. Forked ranks given this ``env``
    (``run_ranks`` adds torchrun's RANK, WORLD_SIZE, MASTER_*) see what launched workers see.
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args([*launch_args, "train.py"]))
    assert args.multi_gpu or args.use_fsdp, "not a torchrun launch: the simple launcher sets other variables"
    return {name: value for name, value in prepare_multi_gpu_env(args).items() if os.environ.get(name) != value}


def run_single(script_args: list[str], env: dict[str, str] | None = None, timeout: float = 240,
               script: str | os.PathLike = TRAIN_SCRIPT) -> subprocess.CompletedProcess:
    """`python train.py ARGS`: one process, no launcher (faults as in ``launch``)."""
    script = _faulty_if_asked(script, env)
    return subprocess.run([sys.executable, str(script), *script_args], env=suite_env(env), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def run_python(code: str, env: dict[str, str | None] | None = None,
               timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -c CODE`` from the repository root, in the launches' environment (``env`` overrides it)."""
    return subprocess.run([sys.executable, "-c", code], env=suite_env(env), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def train_ranks(args: list[str], world_size: int = 2, env: dict[str, str] | None = None,
                timeout: float = 120) -> list[dict]:
    """``train(parse_args(args))`` on forked ranks of a gloo group (or one plain process); summaries by rank."""
    from accel_ddp.cli.args import parse_args
    from accel_ddp.loop import train

    return run_ranks(lambda: train(parse_args(args)), world_size, timeout=timeout, env=env)


def train_ranks_in_turn(runs: list[list[str]], world_size: int = 2, env: dict[str, str] | None = None,
                        timeout: float = 120) -> list[list[dict]]:
    """``train(parse_args(args))`` for each ``args`` of ``runs``, one after another in the same forked ranks (a
    second run in a process forms the group again: accel_ddp.distributed.world.forget_ended_world); summaries by run,
    then by rank. Runs a test compares, without forking and warming up each rank once per run (~0.3 s of CPU each)."""
    from accel_ddp.cli.args import parse_args
    from accel_ddp.loop import train

    by_rank = run_ranks(lambda: [train(parse_args(args)) for args in runs], world_size, timeout=timeout, env=env)
    return [list(summaries) for summaries in zip(*by_rank, strict=True)]


def main_ranks(args: list[str], world_size: int = 2, env: dict[str, str] | None = None,
               timeout: float = 120) -> list[int]:
    """The CLI's ``main(args)`` on forked ranks: each rank's exit code (2 for bad input, 75 preempted, ...)."""
    from accel_ddp.cli.train import main

    return run_ranks(lambda: main(args), world_size, timeout=timeout, env=env)


def read_summary(output_dir: str | os.PathLike) -> dict:
    return json.loads((Path(output_dir) / "summary.json").read_text())


def read_metrics(output_dir: str | os.PathLike) -> list[dict]:
    """Every record of OUTPUT_DIR/metrics.jsonl, in order."""
    text = (Path(output_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_weights(output_dir: str | os.PathLike) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(output_dir) / "model.safetensors"))


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nSTDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    )
    return result


@contextlib.contextmanager
def running(args: list[str], out_dir: Path, env: dict[str, str] | None = None,
            launcher: tuple[str, ...] = ACCELERATE_LAUNCH,
            launch_args: list[str] | None = None) -> Iterator[subprocess.Popen]:
    """Like ``launch``, but yields the running launcher so the test can signal the job.

    Whatever happens in the test, no process of the job outlives it.
    """
    cmd = [sys.executable, *launcher, "--config_file", str(CPU_2PROC), "--num_processes", "2",
           "--main_process_port", str(free_port()), *(launch_args or []), str(_faulty_if_asked(TRAIN_SCRIPT, env)),
           *args]
    with open(out_dir.parent / f"{out_dir.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=suite_env(env), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_job(proc)


def log_of(out_dir: Path) -> str:
    return (out_dir.parent / f"{out_dir.name}.log").read_text().replace("\r", "\n")


def wait_for_checkpoint(proc: subprocess.Popen, out_dir: Path, step: int, timeout: float = 180) -> None:
    marker = out_dir / "checkpoints" / f"step_{step:08d}" / MARKER_NAME
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None, f"the job ended (exit {proc.returncode}) early:\n{log_of(out_dir)[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step} after {timeout} s"
        time.sleep(0.02)


def workers_of(proc: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the training processes under the launcher (they run in their own sessions)."""
    found = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
            if rank is not None and "train.py" in " ".join(child.cmdline()):
                found[int(rank)] = child.pid
        except psutil.NoSuchProcess:
            pass
    return found


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every worker at once, as a node failure would."""
    for pid in [*workers_of(proc).values(), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
