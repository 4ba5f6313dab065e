"""Where accel_ddp's per-step host time goes, against the bare loop: each piece of a step timed alone.

One process, no launcher, the pieces accel_ddp's ``fit()`` runs per optimizer step (its device
loader, task, loss bookkeeping, update, schedule, timers, preemption check, non-finite watch) and
the bare loop's (``bare_ddp.py``), each called many times in a row; each figure is the best of
several repeats, so a busy machine disturbs it far less than the steps/s of ``tax.py``. The sum of
the differences is the host time accel_ddp adds per step; on a GPU most of it is kernel launches
(one per small tensor operation), which is what a launch-bound model feels.

    python benchmarks/step_parts.py                 # the README's main run: digits MLP, 32 per rank
    python benchmarks/step_parts.py --workload cnn  # mnist_cnn, 64 per rank
"""

from __future__ import annotations

import os
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import parser  # noqa: E402


def build(workload: str):
    """Everything one step of each loop touches, built as accel_ddp's setup and bare_ddp.py build it."""
    from accelerate import Accelerator

    from accel_ddp.bad_steps import LossWatch
    from accel_ddp.data import DeviceLoader, build_datasets
    from accel_ddp.lifecycle.preemption import PreemptionWatcher
    from accel_ddp.models import build_model
    from accel_ddp.optim.build import build_lr_scheduler, build_optimizer, use_fused_optimizer
    from accel_ddp.step.losses import LossAccumulator
    from accel_ddp.step.update import build_update
    from accel_ddp.tasks.protocol import build_task
    from accel_ddp.tracking.meters import EpochTimer, progress_bar

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), step_scheduler_with_optimizer=False)
    device = accelerator.device
    if workload == "mlp":
        bundle, batch = build_datasets("digits", "data", False), 32
        model = build_model("mlp", bundle.num_classes, bundle.input_shape, hidden_size=256)
    else:
        from benchmarks.common import mnist_split

        bundle, batch = mnist_split("", False), 64
        model = build_model("mnist_cnn", bundle.num_classes, bundle.input_shape)
    optimizer = build_optimizer("adamw", model, 3e-3, 0.0, fused=use_fused_optimizer("adamw", device.type))
    scheduler = build_lr_scheduler(optimizer, "cosine", 0, 10**9)
    model, optimizer, scheduler = accelerator.prepare(model.to(device), optimizer, scheduler)
    loader = DeviceLoader(bundle.train, batch, batch, seed=0, device=device)
    data = bundle.train.to(device)
    inputs, labels = data.transform(data.inputs), data.labels  # the bare loop's normalised floats
    index = torch.arange(batch, device=device)
    return {
        "accelerator": accelerator, "model": model, "optimizer": optimizer, "torch_optimizer": optimizer.optimizer,
        "scheduler": scheduler, "loader": loader, "inputs": inputs, "labels": labels, "index": index,
        "task": build_task("classification", None, (), torch.contiguous_format),
        "losses": LossAccumulator(accelerator, 1, batch), "watch": LossWatch(accelerator, 0),
        "update": build_update(accelerator, model, optimizer, 1.0), "timer": EpochTimer(batch),
        "bar": progress_bar(10**9, 0, False), "preemption": PreemptionWatcher(accelerator),
        "params": list(model.parameters()),
    }


def pieces(s: dict) -> list[tuple[str, object, object]]:
    """(piece, accel_ddp's callable, the bare loop's callable or None) for one step's work."""
    model, params, index = s["model"], s["params"], s["index"]
    batches = [iter(s["loader"])]

    def next_batch():
        try:
            return next(batches[0])
        except StopIteration:
            batches[0] = iter(s["loader"])
            return next(batches[0])

    x, y = next_batch()
    saved = [torch.randn_like(p) for p in params]

    def with_grads(step):
        def run():
            for p, g in zip(params, saved, strict=True):
                p.grad = g.clone()
            step()
        return run

    def accel_forward_backward():
        s["losses"].backward(s["task"].training_loss(model, (x, y)))

    def bare_update():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        s["torch_optimizer"].step()
        s["torch_optimizer"].zero_grad(set_to_none=True)

    def accel_step():
        batch = next_batch()
        with s["accelerator"].accumulate(model):
            s["losses"].backward(s["task"].training_loss(model, batch))
            if s["accelerator"].sync_gradients:
                s["losses"].finish_step(model)
                s["update"]()
        s["losses"].step_done()
        s["scheduler"].step()
        s["watch"].after_step(s["losses"].running_loss)
        s["timer"].step_done()
        s["bar"].update(1)
        s["preemption"].stop_requested()

    def bare_step():
        xb, yb = torch.index_select(s["inputs"], 0, index), torch.index_select(s["labels"], 0, index)
        F.cross_entropy(model(xb), yb).backward()
        bare_update()

    return [
        ("batch: device loader (gather uint8, normalise) | gather floats", next_batch,
         lambda: (torch.index_select(s["inputs"], 0, index), torch.index_select(s["labels"], 0, index))),
        ("forward, loss, backward: task + LossAccumulator | plain", accel_forward_backward,
         lambda: F.cross_entropy(model(x), y).backward()),
        ("update: fused clip, step, zero_grad | torch clip_grad_norm_, step, zero_grad",
         with_grads(s["update"]), with_grads(bare_update)),
        ("with accelerator.accumulate(model)", lambda: s["accelerator"].accumulate(model).__enter__(), None),
        ("scheduler.step()", s["scheduler"].step, None),
        ("LossWatch.after_step (non-finite loss watch)", lambda: s["watch"].after_step(s["losses"].running_loss), None),
        ("EpochTimer.step_done + progress bar update", lambda: (s["timer"].step_done(), s["bar"].update(1)), None),
        ("PreemptionWatcher.stop_requested (no process group)", s["preemption"].stop_requested, None),
        ("whole step", accel_step, bare_step),
    ]


def best_us(fn, number: int, repeats: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def main() -> int:
    p = parser(__doc__, repeats=(7, "timings per piece and round; the best counts"),
               rounds=(3, "rounds over all pieces (interleaved); the best counts"))
    p.add_argument("--workload", choices=("mlp", "cnn"), default="mlp")
    p.add_argument("--number", type=int, default=200, help="calls per timing")
    args = p.parse_args()
    torch.manual_seed(0)
    state = build(args.workload)
    rows = pieces(state)
    best: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, accel, bare in rows:
            for side, fn in (("accel", accel), ("bare", bare)):
                if fn is not None:
                    best.setdefault(f"{name}/{side}", []).append(best_us(fn, args.number, args.repeats))
    print(f"{args.workload}, 1 process, device {state['accelerator'].device}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '-')}; us per call, best of {args.rounds} x {args.repeats} timings "
          f"of {args.number} calls")
    head = f"{'piece (accel_ddp | bare loop)':80} {'accel_ddp':>10} {'bare':>10} {'added':>8}"
    print(head + "\n" + "-" * len(head))
    for name, _, bare in rows:
        accel_us = min(best[f"{name}/accel"])
        bare_us = min(best[f"{name}/bare"]) if bare is not None else 0.0
        bare_text = f"{bare_us:10.1f}" if bare is not None else f"{'-':>10}"
        print(f"{name:80} {accel_us:10.1f} {bare_text} {accel_us - bare_us:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
