"""How long training stands still per checkpoint: synchronous save against --async_checkpointing.

One process, a model whose state is hundreds of MiB (weights + AdamW's two moments), a few saves
each way through accel_ddp's own CheckpointManager. The stall is the main thread's time inside
``save()``; for the async path that is the host snapshot (the write goes on in the background and is
awaited, outside the timing, before the next save, as the loop's next save would). Target: async
stall <= 20% of the sync one. A figure, never a test: it depends on the disk and on the machine's load.

    python benchmarks/checkpoint_stall.py --width 2048 --layers 4 --saves 3
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the clone's accel_ddp, as bare_ddp.py does
from accel_ddp.checkpoint.manager import CheckpointManager  # noqa: E402
from accel_ddp.checkpoint.train_state import TrainState  # noqa: E402
from benchmarks.common import parser, ratio  # noqa: E402


def build(width: int, layers: int, accelerator: Accelerator):
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model(torch.randn(8, width, device=accelerator.device)).sum().backward()
    optimizer.step()  # AdamW's moments exist: the state is ~3x the weights
    return model, optimizer, scheduler


def stalls(accelerator, model, optimizer, scheduler, folder: str, saves: int, asynchronous: bool) -> list[float]:
    facts = {"steps_per_epoch": 1000, "world_size": 1, "global_batch_size": 8}
    state = TrainState(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler)
    manager = CheckpointManager(accelerator, folder, keep_last=2, run_facts=facts, state=state,
                                async_timeout=600 if asynchronous else None)
    out = []
    for i in range(1, saves + 1):
        manager.wait()  # the previous write, outside the timing (the loop trains meanwhile)
        started = time.perf_counter()
        manager.save(i)
        out.append(time.perf_counter() - started)
    manager.wait()
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--width", type=int, default=2048, help="features of each linear layer")
    p.add_argument("--layers", type=int, default=4, help="linear layers")
    p.add_argument("--saves", type=int, default=3, help="saves each way; the median counts")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = p.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, optimizer, scheduler = build(args.width, args.layers, accelerator)
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 / 2**20
    print(f"state ~{mib:.0f} MiB (weights + 2 AdamW moments), device {accelerator.device}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        sync = stalls(accelerator, model, optimizer, scheduler, os.path.join(tmp, "sync"), args.saves, False)
        asyn = stalls(accelerator, model, optimizer, scheduler, os.path.join(tmp, "async"), args.saves, True)
    for name, figures in (("sync", sync), ("async", asyn)):
        print(f"{name:5s} stall per save: " + ", ".join(f"{s * 1000:.0f} ms" for s in figures)
              + f" (median {sorted(figures)[len(figures) // 2] * 1000:.0f} ms)")
    print(f"async / sync stall: {ratio(sorted(asyn)[len(asyn) // 2], sorted(sync)[len(sync) // 2], '.1%')} "
          "(target <= 20%)")


if __name__ == "__main__":
    main()
