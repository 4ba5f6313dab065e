"""Shared helpers: forked ranks (tests/multiproc.py) and real launches over gloo on loopback.

The test process imports torch, Accelerate and accel_ddp once, here, so that the ranks forked by
``tests.multiproc.run_ranks`` start with everything loaded.

The suite tests CPU semantics, also on a GPU machine: before torch loads, the test process hides
every GPU (``CUDA_VISIBLE_DEVICES=''``), so forked ranks and launches see none. Tests that need a
GPU opt in with ``@pytest.mark.gpu``, run their work in a subprocess with ``gpu_env()`` (the GPUs
the machine offered), and are skipped where there is none (``pytest -m gpu`` runs only them).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The GPUs this machine offers the suite, before it hides them (None: all of them).
OFFERED_GPUS = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: CPU semantics tests stay on the CPU

# Before torch loads: two ranks on two cores, no thread oversubscription; nothing reaches the network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
for _name, _value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
                      "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ[_name] = _value

import datasets  # noqa: E402,F401 - Accelerate imports it to prepare any DataLoader: 1.6 s per rank otherwise
import matplotlib.figure  # noqa: E402,F401 - curves.png on every main process
import pytest  # noqa: E402
import torch._dynamo  # noqa: E402,F401 - torch.optim imports it on first use: ~2 s once here, not per rank

import accel_ddp.loop  # noqa: E402,F401 - torch, Accelerate and the package, for every forked rank
from tests.multiproc import free_port, run_ranks  # noqa: E402

_PLOT = accel_ddp.tracking.recorder.RunRecorder.plot  # writes curves.png; see _no_curves_png

REPO = Path(__file__).resolve().parents[1]
CPU_2PROC = REPO / "accelerate_configs" / "cpu_2proc.yaml"
TRAIN_SCRIPT = REPO / "train.py"
SCRIPTS = REPO / "tests" / "scripts"
FAULTY_TRAIN = SCRIPTS / "faulty_train.py"  # train.py plus the FAULT_* injections of tests/faults.py


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
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
    result = subprocess.run([sys.executable, "-c", probe], env=_env(gpu_env()), capture_output=True, text=True,
                            timeout=120)
    return int(result.stdout.strip() or 0) if result.returncode == 0 else 0


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and gpu_count() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none usable here); the rest of the suite runs on the CPU")
        for item in gpu_tests:
            item.add_marker(skip)


def _faulty_if_asked(script, env):
    if script == TRAIN_SCRIPT and any(name.startswith("FAULT_") for name in env or {}):
        return FAULTY_TRAIN
    return script


def launch(script_args: list[str], nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 240,
           script: str | os.PathLike = TRAIN_SCRIPT, launch_args: list[str] | None = None,
           cwd: str | os.PathLike | None = None,
           config_file: str | os.PathLike | None = CPU_2PROC) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file cpu_2proc.yaml SCRIPT ARGS` as a user would type it.

    With FAULT_* variables in ``env`` the default script is tests/scripts/faulty_train.py, which reads them.
    ``config_file=None``: plain `accelerate launch SCRIPT ARGS`, which reads Accelerate's default config
    (give ``HF_HOME`` in ``env``); ``nproc`` and the free port are then the config's business.
    """
    script = _faulty_if_asked(script, env)
    flags = [] if config_file is None else ["--config_file", str(config_file), "--num_processes", str(nproc),
                                           "--main_process_port", str(free_port())]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, *(launch_args or []), str(script), *script_args]
    return subprocess.run(cmd, env=_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO)


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
    return subprocess.run([sys.executable, str(script), *script_args], env=_env(env), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def run_python(code: str, env: dict[str, str | None] | None = None,
               timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -c CODE`` from the repository root, in the launches' environment (``env`` overrides it)."""
    return subprocess.run([sys.executable, "-c", code], env=_env(env), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def train_ranks(args: list[str], world_size: int = 2, env: dict[str, str] | None = None,
                timeout: float = 120) -> list[dict]:
    """``train(parse_args(args))`` on forked ranks of a gloo group (or one plain process); summaries by rank."""
    from accel_ddp.cli.args import parse_args
    from accel_ddp.loop import train

    return run_ranks(lambda: train(parse_args(args)), world_size, timeout=timeout, env=env)


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


@pytest.fixture(scope="session", autouse=True)
def _no_curves_png():
    """Forked runs leave out curves.png: ~0.3 s of Agg rendering on the main rank at the end of each of ~90 runs
    that no assertion looks at (a failed plot only warns). Tests marked ``curves`` plot; launched runs always do."""
    from accel_ddp.tracking.recorder import RunRecorder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunRecorder, "plot", lambda self: None)
        yield


@pytest.fixture(autouse=True)
def _curves_png_where_marked(request, _no_curves_png):
    """``@pytest.mark.curves``: the test reads or lists curves.png, or breaks the plot on purpose."""
    if request.node.get_closest_marker("curves") is None:
        yield
        return
    from accel_ddp.tracking.recorder import RunRecorder

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunRecorder, "plot", _PLOT)
        yield


@pytest.fixture(autouse=True)
def _library_log_handlers_outlive_the_test():
    """Transformers makes its log handler on first use, on whatever ``sys.stderr`` is then: inside a test, the
    test's capture, closed when the test ends. A later test's forked ranks would log into the closed file ("I/O
    operation on closed file" tracebacks on stderr). After each test the handler writes to the process's stderr."""
    yield
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        for handler in hf_logging._get_library_root_logger().handlers:
            if type(handler) is logging.StreamHandler:  # its own, not a capture handler of pytest
                handler.stream = sys.__stderr__  # not setStream: it flushes the closed one first
                handler.__dict__.pop("flush", None)  # Transformers bound the capture's flush to it


@pytest.fixture
def launcher_store():
    """A TCPStore as torchrun's agent hosts it, and the environment it gives its workers to share it."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0"}
    yield store, env


@pytest.fixture
def tiny_args() -> list[str]:
    """A synthetic run that takes a couple of seconds."""
    return ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
            "--model", "mlp", "--hidden_size", "32", "--global_batch_size", "32", "--epochs", "2"]
