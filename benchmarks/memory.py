"""Memory per rank on the memory-mapped path does not grow with the dataset: N and 8N images, one epoch each.

    python benchmarks/memory.py                    # N = 22,000 64x64 RGB PNGs (8N decoded: 2.01 GiB)
    python benchmarks/memory.py --n 4000 --json results.json

It writes two image datasets as parquet files (PNG bytes, 10 classes, a 500-image test split),
N and 8N training images, converts each once to the Arrow cache (``load_dataset("parquet")``,
outside the measured runs), then trains one epoch of each through ``accelerate launch`` on
``--processes`` ranks with ``--device_loader_max_mb 0`` (the memory-mapped path at any size) and
the default DataLoader worker count, and reports from each run's summary.json and metrics.jsonl:
every rank's peak RSS and its workers', training samples/s and the share of step time spent
waiting for data. Targets: peak RSS(8N) <= 1.2 x peak RSS(N), data-wait share < 10%.

``--in_memory`` adds a third run: 8N decoded into memory (``--loader dataloader`` with the default
threshold), for comparison. Everything goes under ``--work`` (default: a temporary folder, removed
afterwards unless ``--keep``), the Hugging Face cache included.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, bench_env, launch_cmd, parser, write_json  # noqa: E402

SHARD_ROWS = 4000  # images per parquet file
CLASSES = 10


def parse_args(argv=None) -> argparse.Namespace:
    parser_ = parser(__doc__, processes=(2, "ranks (accelerate launch --num_processes)"), json=None)
    parser_.add_argument("--n", type=int, default=22_000, help="images in the small set; the large one has 8x")
    parser_.add_argument("--size", type=int, default=64, help="image side in pixels (RGB)")
    parser_.add_argument("--model", default="mlp", help="accel_ddp model (mlp: hidden 256)")
    parser_.add_argument("--global_batch_size", type=int, default=128, help="samples per optimizer step")
    parser_.add_argument("--num_workers", type=int, default=None, help="DataLoader workers per rank; default auto")
    parser_.add_argument("--in_memory", action="store_true", help="also train 8N decoded into memory")
    parser_.add_argument("--work", default=None, help="folder for the data, cache and runs; default a temp folder")
    parser_.add_argument("--keep", action="store_true", help="keep --work afterwards")
    return parser_.parse_args(argv)


def write_images(folder: Path, n_train: int, n_test: int, size: int, seed: int) -> None:
    """Parquet shards of PNGs: blocky random colours plus noise (compresses like photos do, ~9 KB each)."""
    import datasets
    from PIL import Image

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=CLASSES)})
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    shards = [("train", start, min(SHARD_ROWS, n_train - start)) for start in range(0, n_train, SHARD_ROWS)]
    for split, start, count in [*shards, ("test", 0, n_test)]:
        images, labels = [], rng.integers(0, CLASSES, count).tolist()
        for _ in range(count):
            blocks = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
            pixels = np.kron(blocks, np.ones((8, 8, 1), dtype=np.uint8)).astype(np.int16)
            pixels = np.clip(pixels + rng.integers(-12, 13, pixels.shape), 0, 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
            images.append({"bytes": buffer.getvalue(), "path": None})
        name = "test.parquet" if split == "test" else f"train-{start // SHARD_ROWS:05d}.parquet"
        datasets.Dataset.from_dict({"image": images, "label": labels}, features=features).to_parquet(
            str(folder / name))


def env(work: Path) -> dict[str, str]:
    return bench_env(1, {"HF_DATASETS_CACHE": str(work / "hf_cache")})


def convert(folder: Path, work: Path) -> None:
    """The one-time parquet -> Arrow conversion of load_dataset, done here so that no measured run pays it."""
    code = f"import datasets; datasets.load_dataset('parquet', data_dir={str(folder)!r})"
    subprocess.run([sys.executable, "-c", code], env=env(work), check=True, capture_output=True)


def train(folder: Path, out: Path, work: Path, args: argparse.Namespace, in_memory: bool = False) -> dict:
    flags = ["--dataset", "hf", "--data_dir", str(folder), "--model", args.model, "--epochs", "1",
             "--global_batch_size", str(args.global_batch_size), "--log_every", "50", "--output_dir", str(out)]
    flags += ["--loader", "dataloader"] if in_memory else ["--device_loader_max_mb", "0"]
    if args.num_workers is not None:
        flags += ["--num_workers", str(args.num_workers)]
    result = subprocess.run(launch_cmd(REPO / "train.py", flags, args.processes), env=env(work), capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(f"training failed ({result.returncode}):\n{result.stderr[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epoch = next(r for r in records if "peak_rss_mb" in r)
    return {"data_source": summary["data_source"], "peak_rss_mb": epoch["peak_rss_mb"],
            "peak_worker_rss_mb": epoch["peak_worker_rss_mb"], "summary_peak_rss_mb": summary["peak_rss_mb"],
            "summary_peak_worker_rss_mb": summary["peak_worker_rss_mb"],
            "samples_per_sec": summary["train_samples_per_sec"], "data_wait_share": summary["data_wait_share"],
            "optimizer_steps": summary["optimizer_steps"], "elapsed_sec": summary["elapsed_sec"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="accel_ddp_memory_"))
    results: dict[str, dict] = {}
    try:
        sets = {"N": args.n, "8N": 8 * args.n}
        for name, count in sets.items():
            folder = work / f"data_{name}"
            if not folder.exists():
                write_images(folder, count, 500, args.size, seed=count)
            convert(folder, work)
        runs = [(name, name, False) for name in sets] + ([("8N in memory", "8N", True)] if args.in_memory else [])
        for label, data, in_memory in runs:
            results[label] = train(work / f"data_{data}", work / f"run_{label.replace(' ', '_')}", work, args,
                                   in_memory)
            results[label]["samples"] = sets[data]
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    decoded = 8 * args.n * 3 * args.size * args.size / 2**30
    print(f"\n{args.processes} ranks, {args.model}, global batch {args.global_batch_size}, {args.size}x{args.size} RGB "
          f"PNG in parquet; 8N decoded = {decoded:.2f} GiB\n")
    print("| run | images | data_source | peak RSS per rank (MiB) | peak worker RSS per rank (MiB) | samples/s "
          "| data-wait share |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, r in results.items():
        ranks = ", ".join(f"{v:,.0f}" for v in r["peak_rss_mb"].values())
        workers = ", ".join(f"{v:,.0f}" for v in r["peak_worker_rss_mb"].values())
        print(f"| {label} | {r['samples']:,} | {r['data_source']} | {ranks} | {workers} | "
              f"{r['samples_per_sec']:,.0f} | {r['data_wait_share']:.1%} |")
    ratio = results["8N"]["summary_peak_rss_mb"] / results["N"]["summary_peak_rss_mb"]
    worker_ratio = results["8N"]["summary_peak_worker_rss_mb"] / max(results["N"]["summary_peak_worker_rss_mb"], 1)
    wait = max(results[k]["data_wait_share"] for k in ("N", "8N"))
    print(f"\npeak RSS(8N) / peak RSS(N): ranks {ratio:.2f}, workers {worker_ratio:.2f} (target <= 1.2); "
          f"largest data-wait share {wait:.1%} (target < 10%)")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    return 0 if ratio <= 1.2 and worker_ratio <= 1.2 and wait < 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
