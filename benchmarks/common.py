"""The benchmarks' shared harness: the MNIST split and models, the shared options, launching a variant in its own
process, timing, statistics, ratios and the JSON results file.

Every benchmark script declares its options through ``parser()`` (the shared ones, ``--steps``, ``--rounds``,
``--threads``, ``--out``, ..., with one meaning everywhere), alternates its variants with ``rotated()``, launches
each through ``launch_cmd()``/``run_launch()`` (``accelerate launch``) or ``run_fresh()`` (a fresh interpreter),
prints ``ratio()``s against the baseline run in the same invocation and writes its results with ``write_json()``.

Data comes from ``$ACCEL_DDP_BENCH_MNIST`` (default ``../shared/data/mnist`` next to the
repository), IDX files as distributed (``.gz`` or not):

* only the test set there (``t10k-*``, 10,000 images; this machine): the first 8,000 images train,
  the last 2,000 evaluate;
* the training set too (``train-*``, 60,000 images): the standard split, 60,000 / 10,000;
* neither: MNIST-shaped synthetic digits stand in (8,000 / 2,000), and every benchmark says so
  in its output (``data_source()``).

Datasets for accel_ddp (``--dataset benchmarks.common:NAME``, run from the repository root):

* ``mnist_split``: decoded once into memory, in the form accel_ddp's own ``mnist`` builder returns
  (uint8 ``InMemoryDataset``), so ``--loader auto`` serves it with the fast in-memory loader;
* ``mnist_split_pil``: torchvision ``MNIST`` with ``ToTensor()`` + ``Normalize`` per sample, the
  textbook pipeline of ``textbook_ddp.py``, so that accel_ddp runs on exactly that pipeline too.

Models (``--model benchmarks.common:NAME``): ``cnn_narrow`` and ``cnn_wide``, the examples/mnist
CNN with 16/32 and 64/128 conv channels (accel_ddp's ``mnist_cnn`` has 32/64); ``cnn_pool``, 16/32
channels with a pool after each conv (LeNet's order); ``cnn_bn``, conv-BatchNorm-pool twice at
32/64 channels and a linear classifier (the time-to-accuracy recipe's model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA_ENV = "ACCEL_DDP_BENCH_MNIST"
DEFAULT_MNIST_DIR = REPO.parent / "shared" / "data" / "mnist"
CPU_2PROC = REPO / "accelerate_configs" / "cpu_2proc.yaml"
TINY_GPT2_CONFIG = REPO / "examples" / "configs" / "tiny_gpt2.json"  # docs/tasks.md's 4-layer GPT-2
N_TRAIN, N_EVAL = 8000, 2000  # the split of the 10,000 test images when the training files are absent
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # examples/mnist's Normalize((0.1307,), (0.3081,))
TV_NAMES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
            "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


# ----------------------------------------------------------------------------- data


def mnist_dir() -> Path:
    return Path(os.environ.get(DATA_ENV, str(DEFAULT_MNIST_DIR)))


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write a uint8 array as a plain IDX file (what torchvision's MNIST reads from MNIST/raw)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())
    os.replace(tmp, path)


def synthetic_digits(n: int = N_TRAIN + N_EVAL, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-shaped stand-in: one blurry stroke template per class, shifted and noised; learnable."""
    rng = np.random.default_rng(seed)
    templates = np.zeros((10, 28, 28), np.float32)
    for c in range(10):
        for _ in range(3):  # three random strokes per class
            r0, c0, r1, c1 = rng.integers(6, 22, size=4)
            for t in np.linspace(0, 1, 40):
                r, q = int(r0 + t * (r1 - r0)), int(c0 + t * (c1 - c0))
                templates[c, r - 1:r + 2, q - 1:q + 2] = 1.0
    labels = rng.integers(0, 10, size=n)
    shifts = rng.integers(-2, 3, size=(n, 2))
    images = np.stack([np.roll(templates[y], tuple(s), axis=(0, 1)) for y, s in zip(labels, shifts, strict=True)])
    images = np.clip(images * 220 + rng.normal(0, 30, images.shape), 0, 255)
    return images.astype(np.uint8), labels.astype(np.int64)


def _idx_path(name: str) -> Path | None:
    for candidate in (mnist_dir() / f"{name}.gz", mnist_dir() / name):
        if candidate.is_file():
            return candidate
    return None


def _available() -> set[str]:
    """Which of "train" and "test" have both their IDX files in the data folder."""
    return {part for part, names in TV_NAMES.items() if all(_idx_path(n) for n in names)}


def data_source() -> str:
    found = _available()
    if found == {"train", "test"}:
        return f"real MNIST, standard split: train-* files train, t10k-* files evaluate ({mnist_dir()})"
    if "test" in found:
        return f"real MNIST test set, first {N_TRAIN:,} train / last {N_EVAL:,} eval ({mnist_dir()})"
    return f"SYNTHETIC MNIST-shaped digits, {N_TRAIN:,} / {N_EVAL:,} ({mnist_dir()} has no MNIST; set ${DATA_ENV})"


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images uint8 (N, 28, 28), train labels int64, eval images, eval labels), as data_source() says."""
    found = _available()
    if not found & {"test"}:
        images, labels = synthetic_digits()
        return images[:N_TRAIN], labels[:N_TRAIN], images[N_TRAIN:], labels[N_TRAIN:]

    from accel_ddp.data import read_idx  # accel_ddp's own IDX reader

    def read(part: str) -> tuple[np.ndarray, np.ndarray]:
        images, labels = (read_idx(str(_idx_path(n))).numpy() for n in TV_NAMES[part])
        return images, labels.astype(np.int64)

    test_x, test_y = read("test")
    if "train" in found:
        return (*read("train"), test_x, test_y)
    return test_x[:N_TRAIN], test_y[:N_TRAIN], test_x[N_TRAIN:N_TRAIN + N_EVAL], test_y[N_TRAIN:N_TRAIN + N_EVAL]


def prepare_torchvision_root(root: str | os.PathLike) -> Path:
    """Lay out ``root/MNIST/raw`` so that ``torchvision.datasets.MNIST(root, train=...)`` reads the split.

    ``train=True`` reads the training part of the split and ``train=False`` its evaluation part
    (written under torchvision's file names), so the textbook scripts need no ``Subset``.
    """
    raw = Path(root) / "MNIST" / "raw"
    if all((raw / n).is_file() for names in TV_NAMES.values() for n in names):
        return Path(root)
    raw.mkdir(parents=True, exist_ok=True)
    train_x, train_y, eval_x, eval_y = load_split()
    for (images_name, labels_name), (x, y) in zip(TV_NAMES.values(), ((train_x, train_y), (eval_x, eval_y)),
                                                  strict=True):
        write_idx(raw / images_name, x)
        write_idx(raw / labels_name, y.astype(np.uint8))
    return Path(root)


def mnist_split(data_dir: str, download: bool):
    """accel_ddp dataset: the benchmark split, decoded once (``data_dir`` unused; see ``$ACCEL_DDP_BENCH_MNIST``).

    The same form as ``accel_ddp.data.build_mnist`` returns: uint8 ``InMemoryDataset`` normalised
    on read (normalised float TensorDatasets with an accel_ddp that has no InMemoryDataset).
    """
    import torch
    from torch.utils.data import TensorDataset

    import accel_ddp.data as ad

    sets = []
    train_x, train_y, eval_x, eval_y = load_split()
    for images, labels in ((train_x, train_y), (eval_x, eval_y)):
        x, y = torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.copy())
        if hasattr(ad, "InMemoryDataset"):
            sets.append(ad.InMemoryDataset(x, y, scale=255.0, mean=(MNIST_MEAN,), std=(MNIST_STD,)))
        else:
            sets.append(TensorDataset((x.float() / 255.0 - MNIST_MEAN) / MNIST_STD, y))
    return ad.DatasetBundle(sets[0], sets[1], num_classes=10, input_shape=(1, 28, 28))


def textbook_datasets(root: str | os.PathLike):
    """(train, eval) torchvision MNIST with ToTensor + Normalize per sample: the textbook pipeline."""
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    return (datasets.MNIST(str(root), train=True, download=False, transform=transform),
            datasets.MNIST(str(root), train=False, download=False, transform=transform))


def mnist_split_pil(data_dir: str, download: bool):
    """accel_ddp dataset: the split through torchvision MNIST + ToTensor/Normalize per sample (PIL).

    ``data_dir`` is the torchvision root; its ``MNIST/raw`` is written from the IDX files if missing.
    """
    from accel_ddp.data import DatasetBundle

    train, eval_ = textbook_datasets(prepare_torchvision_root(data_dir))
    return DatasetBundle(train, eval_, num_classes=10, input_shape=(1, 28, 28))


def _cnn(channels: tuple[int, int], num_classes: int, input_shape: tuple[int, ...], hidden: int = 128):
    from torch import nn

    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, channels[0], 3), nn.ReLU(),
        nn.Conv2d(channels[0], channels[1], 3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(),
        nn.Linear(channels[1] * ((h - 4) // 2) * ((w - 4) // 2), hidden), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(hidden, num_classes),
    )


def cnn_narrow(num_classes: int, input_shape: tuple[int, ...]):
    """examples/mnist CNN at half width (16/32 conv channels): about 1/3 of the FLOPs."""
    return _cnn((16, 32), num_classes, input_shape)


def cnn_wide(num_classes: int, input_shape: tuple[int, ...]):
    """examples/mnist CNN at double width (64/128 conv channels)."""
    return _cnn((64, 128), num_classes, input_shape)


def cnn_pool(num_classes: int, input_shape: tuple[int, ...]):
    """LeNet order (conv, pool, conv, pool) at 16/32 channels: about 1/10 of examples/mnist's multiply-adds."""
    from torch import nn

    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.25),
        nn.Linear(32 * (h // 4) * (w // 4), 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, num_classes),
    )


def cnn_bn(num_classes: int, input_shape: tuple[int, ...]):
    """Two padded conv-BatchNorm-ReLU-pool stages (32/64 channels) and one linear layer, no dropout.

    The time-to-accuracy recipe's model: with BatchNorm 1.2 epochs at a high LR reach 98%, where
    the examples/mnist CNN (dropout, no normalisation) needs two. Pooling after each conv keeps it
    near cnn_narrow's multiply-adds (3.9M against 3.3M per image) with 1/12 of its parameters
    (50K: a 0.2 MB gradient all-reduce instead of 2.4 MB).
    """
    from torch import nn

    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), num_classes),
    )


def cnn_bn_half(num_classes: int, input_shape: tuple[int, ...]):
    """cnn_bn at 16/32 channels: twice its samples/s, but 98% only just (98.0-98.7% after 375 steps)."""
    from torch import nn

    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (h // 4) * (w // 4), num_classes),
    )


# ----------------------------------------------------------------------------- launching


def tiny_gpt2():
    """docs/tasks.md's 4-layer GPT-2 (``TINY_GPT2_CONFIG``) with fresh weights from torch's current seed; needs
    transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_GPT2_CONFIG))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of every launched run: pinned thread count, repo on PYTHONPATH, offline, quiet."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TQDM_DISABLE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
    })
    env.pop("ACCELERATE_USE_CPU", None)
    env.update(extra or {})
    return env


def launch_cmd(script: str | os.PathLike, args: list[str], nproc: int, mixed_precision: str = "no") -> list[str]:
    """``accelerate launch --config_file cpu_2proc.yaml --num_processes N SCRIPT ARGS``: torchrun underneath.

    All variants start the same way, so launcher cost is the same for each.
    """
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_2PROC),
            "--num_processes", str(nproc), "--main_process_port", str(free_port()),
            "--mixed_precision", mixed_precision, str(script), *args]


def through(cmd: list[str], wrapper: list[str]) -> list[str]:
    """A ``launch_cmd`` command whose script runs through ``wrapper`` (``[wrapper.py, --flag, ARG]``; the script
    path and its arguments follow), e.g. a profiling wrapper in place of the script."""
    at = cmd.index("--mixed_precision") + 2  # the script follows --mixed_precision VALUE
    return [*cmd[:at], *wrapper, *cmd[at:]]


def fast_bf16_here() -> bool:
    """Whether bf16 autocast beats fp32 on this machine: a bf16-capable GPU, or CPU bf16 units (AMX/AVX512-BF16)."""
    import torch

    from accel_ddp.cli.machine import MachineFacts

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return MachineFacts.detect().cpu_bf16


def run_launch(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float,
               stop_when=None, poll_s: float = 0.2) -> dict:
    """Run a launch in its own process group; return wall seconds, exit code and launch time.

    ``stop_when()`` is polled; when it returns True the whole group gets SIGTERM (time-to-accuracy
    runs stop at the target). A timeout also ends the group.
    """
    launched = time.time()
    t0 = time.perf_counter()
    cpu0 = _children_cpu()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        stopped = False
        try:
            while proc.poll() is None:
                if time.perf_counter() - t0 > timeout:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                if stop_when is not None and stop_when():
                    stopped = True
                    _end_group(proc)
                    break
                time.sleep(poll_s)
        except BaseException:
            _end_group(proc)
            raise
    return {"rc": proc.returncode, "wall_sec": time.perf_counter() - t0, "launched_at": launched, "stopped": stopped,
            "cpu_sec": _children_cpu() - cpu0}


def _children_cpu() -> float:
    """User + system CPU seconds of finished child processes (the launcher and its ranks, once waited for)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group this module started (the launch and its ranks)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, n: int = 30) -> str:
    """The first Python traceback in a log (the root cause of a failed launch), else its last ``n`` lines."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), None)
    if start is not None:
        end = next((j for j in range(start + 1, len(lines)) if lines[j] and not lines[j].startswith((" ", "\t"))),
                   len(lines) - 1)
        return "\n".join(lines[start:end + 1][-n:])
    return "\n".join(lines[-n:])


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so that ``run_launch`` ends the launch it started before exiting."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def slowest_rank(seconds: float) -> tuple[float, bool]:
    """The largest ``seconds`` over the ranks of the process group a peer's framework formed, and whether this is
    rank 0; ``(seconds, True)`` without a group (one process). Under NCCL (a GPU) the tensor must live on this
    rank's GPU: a CPU tensor there fails ("No backend type associated with device type cpu"), the crash that
    cost peers.py its Trainer side on the first GPU run (issue 38)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return seconds, True
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value), dist.get_rank() == 0


def exit_now(code: int = 0) -> None:
    """End a benchmark's rank without interpreter finalization, as ``accel_ddp.exit_process`` ends train.py's.

    A gloo worker thread that still holds the last collective's tensors while the interpreter
    finalizes aborts the process ("terminate called without an active exception", SIGABRT) after a
    run that finished (seen in ~1 of 8 bare_ddp.py launches here); the DDP module keeps the group alive
    past ``destroy_process_group``. Every side of a comparison ends this way, so none loses rounds to it.
    atexit handlers run first (``tax.py --profile`` writes its report in one).
    """
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


# ----------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def accel_epochs(run_dir: Path, samples_per_step: int) -> tuple[list[dict], dict]:
    """(per epoch: optimizer steps, seconds, rank 0's CPU seconds; summary.json) of a finished accel_ddp run, from
    its summary.json and the epoch records of metrics.jsonl (the ones with step-time percentiles)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    per_epoch = summary["steps_per_epoch"]
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "step_time_p50_ms" in r]
    epochs = [{"steps": per_epoch, "seconds": per_epoch * samples_per_step / r["samples_per_sec"],
               "cpu_seconds": per_epoch * r.get("cpu_ms_per_step", math.nan) / 1e3} for r in records]
    return epochs, summary


SKIP_EPOCHS = 1  # the first epoch holds one-time costs (first-step allocations, DDP's bucket rebuild)


def epoch_rates(epochs: list[dict], samples_per_step: int = 1) -> dict:
    """Steps/s, samples/s and CPU ms per step (rank 0's process, all threads) over the epochs after the first
    SKIP_EPOCHS (all of them when there are no more): what tax.py and peers.py report, measured as accel_ddp's
    ``EpochTimer`` measures (an epoch's start to its last optimizer step)."""
    kept = epochs[SKIP_EPOCHS:] or epochs
    steps, seconds = sum(e["steps"] for e in kept), sum(e["seconds"] for e in kept)
    return {"steps_per_sec": steps / seconds, "samples_per_sec": steps * samples_per_step / seconds,
            "cpu_ms_per_step": 1e3 * sum(e["cpu_seconds"] for e in kept) / steps, "steps_per_epoch": kept[0]["steps"]}


def pydoc_lm_folder(tmp: Path) -> str:
    """The causal-LM benchmarks' text folder under ``tmp`` (examples/pydoc_text.py lm), written the first time."""
    folder = tmp / "pydoc_lm"
    if not (folder / "tokenizer").is_dir():
        subprocess.run([sys.executable, str(REPO / "examples" / "pydoc_text.py"), "lm", "--out", str(folder)],
                       check=True, capture_output=True, env=bench_env(1))
    return str(folder)


def spread(values: list[float], spec: str) -> str:
    """``median [min-max]`` of the values that are not None, formatted with ``spec``; "-" for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{format(median(values), spec)} [{format(min(values), spec)}-{format(max(values), spec)}]"


def machine_info(gpu: bool = True) -> dict:
    """The machine of a results file. ``gpu=False`` (a dry run's): no GPU asked for, torch's version read from its
    package metadata, so that torch is not imported (seconds an interpreter on a loaded machine)."""
    import platform
    from importlib.metadata import version

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if gpu:
        import torch

        torch_version = torch.__version__
        gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    else:
        torch_version, gpu_name = version("torch"), None
    try:
        accel_version = version("accelerate")
    except ImportError:  # PackageNotFoundError is one
        accel_version = None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "gpu": gpu_name,
        "python": platform.python_version(),
        "torch": torch_version,
        "accelerate": accel_version,
        "load_avg_at_start": os.getloadavg(),
    }


def fmt(value, spec: str = ".0f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


# ----------------------------------------------------------------------------- the harness: options, runs, results

# The options every benchmark means the same by: (type, help). A script names the ones it takes, with its default.
SHARED_OPTIONS: dict[str, tuple[type, str]] = {
    "steps": (int, "optimizer steps per run (or timed steps per variant and round)"),
    "rounds": (int, "alternated rounds of every variant (the order turns each round); medians reported"),
    "repeats": (int, "repeats of every measurement; see the script for which of them counts"),
    "threads": (int, "OMP_NUM_THREADS per rank; default CPUs // processes"),
    "nproc": (int, "processes (accelerate launch --num_processes)"),
    "processes": (int, "processes (ranks, or copies of a side run at once)"),
    "out": (str, "folder for the results JSON (and logs, plots)"),
    "json": (str, "also write the results here"),
}


def parser(doc: str, **defaults) -> argparse.ArgumentParser:
    """An ArgumentParser titled by the first line of a benchmark's docstring, with the shared options named in
    ``defaults`` (``steps=10``, or ``steps=(10, "its own help")``), in the order given; a script adds its own."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    for name, default in defaults.items():
        kind, help_ = SHARED_OPTIONS[name]
        if isinstance(default, tuple):
            default, help_ = default
        p.add_argument(f"--{name}", type=kind, default=default, help=help_)
    return p


def threads_per_rank(threads: int | None, nproc: int) -> int:
    """``--threads``, else the CPUs shared fairly among ``nproc`` ranks."""
    return threads or max(1, (os.cpu_count() or 1) // nproc)


def rotated(variants: list | tuple, round_: int) -> list:
    """The variants in this round's order: turned by one each round (two variants: the baseline first in even
    rounds), so that none always runs first on a machine that warms up or cools down."""
    turn = round_ % len(variants)
    return [*variants[turn:], *variants[:turn]]


def alternated(variants: list | tuple, round_: int) -> list:
    """The variants as given in even rounds, reversed in odd ones (the baseline first in even rounds)."""
    return list(variants) if round_ % 2 == 0 else list(reversed(variants))


def best_per_call(fn, calls: int, repeats: int = 5) -> float:
    """Seconds per call of ``fn(i)`` (``i`` the call's index), the best of ``repeats`` timings of ``calls`` calls in a
    row: the timing a busy machine disturbs least."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def cpu_ms_per_call(fn, calls: int) -> float:
    """This process's CPU milliseconds per call of ``fn()`` over ``calls`` calls in a row."""
    started = time.process_time()
    for _ in range(calls):
        fn()
    return 1e3 * (time.process_time() - started) / calls


def ratio(value: float | None, baseline: float | None, spec: str = ".2f") -> str:
    """``value / baseline`` formatted, "-" where either is missing, nan or the baseline is 0."""
    if value is None or baseline is None or baseline == 0 or math.isnan(value) or math.isnan(baseline):
        return "-"
    return format(value / baseline, spec)


def machine_line(machine: dict, settings: str = "") -> str:
    """The ``machine: ...`` line every comparison prints above its table."""
    return (f"machine: {machine['cpu']}, {machine['cpus']} CPUs, gpu {machine['gpu']}, torch {machine['torch']}, "
            f"accelerate {machine['accelerate']}, load {machine['load_avg_at_start'][0]:.1f} at the start"
            + (f"; {settings}" if settings else ""))


def write_json(path: str | os.PathLike, data, say: bool = True) -> Path:
    """The results file: indented JSON (anything else as ``str``), written whole (a reader never sees half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    if say:
        print(f"wrote {path}")
    return path


def run_fresh(argv: list, env: dict[str, str] | None = None, copies: int = 1, timeout: float = 1200) -> list[dict]:
    """Run ``python ARGV`` in fresh interpreters (no allocator, thread pool or compile state shared with another
    variant), ``copies`` of them at once, and return the JSON object the last line of each one's output holds;
    exit with the output's tail where one fails."""
    cmd = [sys.executable, *map(str, argv)]
    procs = [subprocess.Popen(cmd, env=env or bench_env(1), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(copies)]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        lines = out.strip().splitlines()
        if proc.returncode != 0 or not lines:
            sys.exit(f"{' '.join(cmd[1:])} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
        answers.append(json.loads(lines[-1]))
    return answers

