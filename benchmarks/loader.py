"""Training throughput of the input pipelines against the model's own limit, 1 and 2 processes.

    python benchmarks/loader.py                        # 1 and 2 processes; prints a Markdown table
    python benchmarks/loader.py --processes 1 --model mnist_cnn --json results.json

Per world size, one launch measures, on the same model, optimizer and global batch:

- ``fast``: the in-memory DeviceLoader (uint8 on the device, batched gather and normalisation);
- ``dataloader``: accel_ddp's DataLoader path (``HostLoader``) over the same in-memory data;
- ``textbook``: a DataLoader over per-sample PIL images with ``ToTensor`` and ``Normalize``, the
  recipe of most tutorials (``--num_workers`` workers; 0 by default on small CPU machines);
- ``compute``: the compute-only limit, the same training step on one fixed batch already on the
  device, with no input pipeline at all.

It also times each input pipeline alone (``data only``: iterating the loader, no training), which
says how much of a step the pipeline costs and is far less sensitive to other load on the machine.

Each is the train.py step (forward, backward with Accelerate's gradient sync, clipping, AdamW),
timed after a warm-up over whole optimizer steps, best of ``--repeats`` interleaved rounds (the
least disturbed by other work on the machine). Data: the real MNIST test set from
``../shared/data/mnist`` where present (8,000 images to train on), else 8,000 synthetic 28x28
uint8 images. On a GPU machine the 2-process run needs two GPUs; it is skipped with one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, bench_env, launch_cmd, parser, threads_per_rank, write_json  # noqa: E402

MNIST_DIR = REPO.parent / "shared" / "data" / "mnist"
MODES = ("compute", "fast", "dataloader", "textbook")  # compute and fast back to back: alike conditions


def parse_args(argv=None) -> argparse.Namespace:
    parser_ = parser(__doc__, steps=(30, "timed optimizer steps per mode and round"),
                     repeats=(5, "interleaved rounds; the best is reported"), json=None)
    parser_.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="world sizes to measure")
    parser_.add_argument("--model", default="mlp", help="accel_ddp model name (mlp, mnist_cnn, resnet18)")
    parser_.add_argument("--global_batch_size", type=int, default=256, help="samples per optimizer step")
    parser_.add_argument("--warmup", type=int, default=10, help="untimed optimizer steps first")
    parser_.add_argument("--num_workers", type=int, default=None, help="textbook DataLoader workers per rank")
    parser_.add_argument("--data_dir", default=str(MNIST_DIR), help="folder with t10k-*-idx*-ubyte.gz")
    parser_.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: result file of a launch
    return parser_.parse_args(argv)


# ----------------------------------------------------------------------------- one launch (every rank)


def load_mnist_sized(data_dir: str):
    """(images uint8 (N, 1, 28, 28), labels, source): the real MNIST test set, else synthetic digits-sized data."""
    import torch

    from accel_ddp.data import read_idx

    images_path = os.path.join(data_dir, "t10k-images-idx3-ubyte.gz")
    labels_path = os.path.join(data_dir, "t10k-labels-idx1-ubyte.gz")
    if os.path.isfile(images_path) and os.path.isfile(labels_path):
        return read_idx(images_path)[:8000].unsqueeze(1), read_idx(labels_path)[:8000].long(), "MNIST test set"
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8000, 1, 28, 28), dtype=torch.uint8, generator=gen)
    return images, torch.randint(0, 10, (8000,), generator=gen), "synthetic"


class TextbookMNIST:
    """Per-sample PIL image -> ToTensor -> Normalize: what a torchvision MNIST dataset does on every read."""

    def __init__(self, images, labels):
        from torchvision import transforms

        self.images, self.labels = images, labels
        self.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[index, 0].numpy(), mode="L")), int(self.labels[index])


def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator, DataLoaderConfiguration, PartialState
    from torch.utils.data import DataLoader

    from accel_ddp.data import MNIST_MEAN, MNIST_STD, InMemoryDataset, build_loaders
    from accel_ddp.models import build_model
    from accel_ddp.optim.build import build_optimizer, use_fused_optimizer

    cuda = torch.cuda.is_available()
    world = PartialState(cpu=not cuda).num_processes
    per_device = args.global_batch_size // world
    accelerator = Accelerator(
        cpu=not cuda, gradient_accumulation_steps=1, step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0, non_blocking=cuda),
    )
    images, labels, source = load_mnist_sized(args.data_dir)
    dataset = InMemoryDataset(images, labels, mean=(MNIST_MEAN,), std=(MNIST_STD,), scale=255.0)
    torch.manual_seed(0)
    model = build_model(args.model, 10, (1, 28, 28))
    fused = use_fused_optimizer("adamw", "cuda" if cuda else "cpu")
    optimizer = build_optimizer("adamw", model, 1e-3, 0.0, fused=fused)
    model, optimizer = accelerator.prepare(model, optimizer)

    def train_step(inputs, targets):  # the body of train.py's loop
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(inputs).float(), targets)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def loader_for(mode):
        if mode == "fast":
            return build_loaders(accelerator, dataset, None, per_device_batch_size=per_device,
                                 global_batch_size=args.global_batch_size, loader="device").train
        if mode == "dataloader":
            return build_loaders(accelerator, dataset, None, per_device_batch_size=per_device,
                                 global_batch_size=args.global_batch_size, loader="dataloader").train
        workers = args.num_workers if args.num_workers is not None else (2 if (os.cpu_count() or 1) >= 8 else 0)
        textbook = TextbookMNIST(images, labels)  # the tutorials' DataLoader, sharded by Accelerate
        return accelerator.prepare(DataLoader(textbook, batch_size=per_device, shuffle=True, drop_last=True,
                                              num_workers=workers, persistent_workers=workers > 0))

    fixed = next(iter(loader_for("fast")))

    def batches(loader):
        epoch = 0
        while True:
            if loader is None:
                yield fixed
                continue
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    def measure(mode, train=True) -> float:
        stream = batches(None if mode == "compute" else loader_for(mode))
        step = train_step if train else (lambda inputs, targets: None)
        for _ in range(args.warmup):
            step(*next(stream))
        sync(cuda)
        accelerator.wait_for_everyone()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(*next(stream))
        sync(cuda)
        elapsed = time.perf_counter() - start
        elapsed = accelerator.reduce(torch.tensor(elapsed, device=accelerator.device), "max").item()
        stream.close()
        return args.steps * args.global_batch_size / elapsed

    best = dict.fromkeys(MODES, 0.0)
    data_only = dict.fromkeys(MODES[1:], 0.0)
    for _ in range(args.repeats):
        for mode in MODES:
            best[mode] = max(best[mode], measure(mode))
        for mode in data_only:
            data_only[mode] = max(data_only[mode], measure(mode, train=False))
    if accelerator.is_main_process:
        Path(args.worker).write_text(json.dumps({
            "processes": world, "device": accelerator.device.type, "model": args.model, "data": source,
            "global_batch_size": args.global_batch_size, "per_device_batch_size": per_device,
            "samples_per_sec": best, "data_only_samples_per_sec": data_only,
        }))
    accelerator.end_training()


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- the driver


def launch(args: argparse.Namespace, processes: int, result: Path) -> dict | None:
    import torch

    forwarded = [
        "--model", args.model, "--global_batch_size", str(args.global_batch_size), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--data_dir", args.data_dir,
        "--worker", str(result), *(["--num_workers", str(args.num_workers)] if args.num_workers is not None else []),
    ]
    # the caller's OMP_NUM_THREADS, else the cores shared fairly
    env = bench_env(int(os.environ.get("OMP_NUM_THREADS") or threads_per_rank(None, processes)))
    if processes == 1:
        cmd = [sys.executable, __file__, *forwarded]
    else:
        if torch.cuda.is_available() and torch.cuda.device_count() < processes:
            print(f"skipping {processes} processes: {torch.cuda.device_count()} GPU(s)", file=sys.stderr)
            return None
        cmd = launch_cmd(__file__, forwarded, processes)
    subprocess.run(cmd, env=env, check=True, cwd=REPO)
    return json.loads(result.read_text())


def table(results: list[dict]) -> str:
    """Training samples/s per mode, then each pipeline's data-only rate (both over all ranks together)."""
    lines = ["| processes | device | fast | dataloader | textbook | compute-only | fast / compute |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        s = r["samples_per_sec"]
        lines.append(f"| {r['processes']} | {r['device']} | {s['fast']:,.0f} | {s['dataloader']:,.0f} | "
                     f"{s['textbook']:,.0f} | {s['compute']:,.0f} | {s['fast'] / s['compute']:.2f} |")
    lines += ["", "| processes | data only: fast | dataloader | textbook |", "| --- | --- | --- | --- |"]
    for r in results:
        d = r["data_only_samples_per_sec"]
        lines.append(f"| {r['processes']} | {d['fast']:,.0f} | {d['dataloader']:,.0f} | {d['textbook']:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.worker:
        run_worker(args)
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for processes in args.processes:
            result = launch(args, processes, Path(tmp) / f"p{processes}.json")
            if result is not None:
                results.append(result)
    first = results[0]
    print(f"\nmodel {first['model']}, global batch {first['global_batch_size']}, data: {first['data']}, "
          f"best of {args.repeats} rounds of {args.steps} optimizer steps\n")
    print(table(results))
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
