"""What LoRA buys on docs/tasks.md's GPT-2: trainable share, checkpoint size and time per step against full
fine-tuning of the same base, on the same data, in the same invocation (docs/tasks.md, "Fine-tuning").

The base is the 4-layer GPT-2 of examples/configs/tiny_gpt2.json (seeded fresh weights, written with
save_pretrained: size and speed do not depend on what it learnt), the data the Python Language Reference's
paragraphs (examples/pydoc_text.py lm), packed into 128-token blocks, one process. Each variant trains --steps
optimizer steps through ``accel_ddp.train`` and saves one checkpoint; the variants take turns, --rounds times, in
this one process (a busy machine's load falls on each alike), and the figures are the median over rounds of
summary.json's step-time median, and the checkpoint folder's bytes. Variants: full fine-tuning, LoRA (r 8 on
every linear layer), LoRA with --gradient_checkpointing, full fine-tuning with --gradient_checkpointing.

    python benchmarks/finetune.py --steps 10 --rounds 3 --out outputs/bench_finetune
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
from pathlib import Path

# The clone's accel_ddp, as bare_ddp.py does, in place of this folder
sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.common import bench_env, median, parser, pydoc_lm_folder, ratio, tiny_gpt2, write_json  # noqa: E402

VARIANTS = {
    "full": [],
    "lora": ["--peft", "lora", "--lora_r", "8"],
    "lora_checkpointing": ["--peft", "lora", "--lora_r", "8", "--gradient_checkpointing"],
    "full_checkpointing": ["--gradient_checkpointing"],
}


def prepare(out: Path) -> tuple[Path, Path]:
    """The data (with its tokenizer) and the base model folder, made once under ``out``."""
    import torch

    data, base = Path(pydoc_lm_folder(out)), out / "base"
    if not (base / "config.json").is_file():
        torch.manual_seed(0)
        tiny_gpt2().save_pretrained(str(base))
    return data, base


def run(name: str, extra: list[str], data: Path, base: Path, out: Path, steps: int, batch: int) -> dict:
    """One variant's run, in this process (``train(parse_args(...))``, as ``python train.py`` would)."""
    from accel_ddp.cli.args import parse_args
    from accel_ddp.loop import train

    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    args = ["--task", "causal_lm", "--dataset", "hf", "--data_dir", str(data), "--tokenizer", str(data / "tokenizer"),
            "--model", str(base), "--packing", "--max_length", "128", "--global_batch_size", str(batch),
            "--max_steps", str(steps), "--checkpointing_steps", str(steps), "--lr", "1e-3", "--eval_every", "0",
            "--log_every", str(steps), "--output_dir", str(folder), *extra]
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train(parse_args(args))
    checkpoint = folder / "checkpoints" / f"step_{steps:08d}"
    return {"step_ms": summary["step_time_p50_ms"],
            "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file()),
            "trainable": summary.get("trainable_parameters"), "total": summary.get("total_parameters")}


def main() -> None:
    p = parser(__doc__, steps=10, rounds=(3, "turns of every variant"), threads=(2, "torch threads"),
               out="outputs/bench_finetune")
    p.add_argument("--global_batch_size", type=int, default=16, help="128-token blocks per step")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, full first")
    args = p.parse_args()
    os.environ.update(bench_env(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data, base = prepare(out)
    names = args.variants.split(",")
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            rounds[name].append(run(name, VARIANTS[name], data, base, out, args.steps, args.global_batch_size))
    results = {name: {**runs[-1], "step_ms": median([r["step_ms"] for r in runs]),
                      "step_ms_rounds": [round(r["step_ms"], 1) for r in runs]} for name, runs in rounds.items()}
    full = results[names[0]]
    print(f"{'variant':<20} {'trainable':>22} {'step p50 ms':>12} {'x full':>7} {'checkpoint':>12} {'x full':>7}")
    for name, r in results.items():
        trainable = f"{r['trainable']:,} ({100 * r['trainable'] / r['total']:.2f}%)" if r["trainable"] else "all"
        size_x = ratio(r["checkpoint_bytes"], full["checkpoint_bytes"], ".3f")
        print(f"{name:<20} {trainable:>22} {r['step_ms']:>12.1f} {ratio(r['step_ms'], full['step_ms']):>7} "
              f"{r['checkpoint_bytes'] / 2**20:>8.2f} MiB {size_x:>7}")
    per_round = ", ".join(f"{name} {r['step_ms_rounds']}" for name, r in results.items())
    print(f"step p50 ms per round: {per_round}")
    write_json(out / "finetune.json", results)


if __name__ == "__main__":
    main()
