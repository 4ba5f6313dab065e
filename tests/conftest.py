"""Shared helpers: real multi-process launches over gloo on loopback, one free port per launch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU_2PROC = REPO / "accelerate_configs" / "cpu_2proc.yaml"
TRAIN_SCRIPT = REPO / "train.py"
SCRIPTS = REPO / "tests" / "scripts"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1",  # two ranks on two cores: no thread oversubscription
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TQDM_DISABLE": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("ACCELERATE_USE_CPU", None)
    env.update(extra or {})
    return env


def launch(script_args: list[str], nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 240,
           script: str | os.PathLike = TRAIN_SCRIPT, launch_args: list[str] | None = None,
           cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file cpu_2proc.yaml SCRIPT ARGS` as a user would type it."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_2PROC),
           "--num_processes", str(nproc), "--main_process_port", str(free_port()), *(launch_args or []),
           str(script), *script_args]
    return subprocess.run(cmd, env=_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO)


def run_single(script_args: list[str], env: dict[str, str] | None = None, timeout: float = 240,
               script: str | os.PathLike = TRAIN_SCRIPT) -> subprocess.CompletedProcess:
    """`python train.py ARGS`: one process, no launcher."""
    return subprocess.run([sys.executable, str(script), *script_args], env=_env(env), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


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


@pytest.fixture
def tiny_args() -> list[str]:
    """A synthetic run that takes a couple of seconds."""
    return ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
            "--model", "mlp", "--hidden_size", "32", "--global_batch_size", "32", "--epochs", "2"]
