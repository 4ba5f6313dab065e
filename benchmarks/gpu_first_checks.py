"""The correctness checks of benchmarks/gpu_first_minutes.sh, one stage per call (the script gives each a timeout):

    chunked        --chunked_loss against the plain loss on GPT-2 124M in bf16 autocast: the loss within 1e-2 and
                   every parameter's gradient within 3e-2 relative (bf16's own error; tests/tasks/test_chunked_loss.py)
    graphs         12 optimizer steps of a 4-layer GPT-2 without dropout, eager and with --cuda_graphs, bf16: every
                   weight within 1e-2 relative of the eager run's, and the captured step replayed (replays > 0)
    compile_count  --compile_regions on a 12-layer GPT-2 (124M's shape; 9 layers dry): graphs dynamo compiles over
                   training steps, an epoch boundary, evaluations under no_grad and a last short batch: at most 3
                   (issue 49 item 1)
    sync           torch.cuda.set_sync_debug_mode("error") from the end of step 3 to the end of step 8 of a run
                   that logs only at its end: any device-to-host sync inside those steps fails the stage, naming it

Each prints one line (``PASS``/``FAIL``/``SKIP`` name, figures) and writes ``OUT/<stage>.json``; exit 1 on FAIL.
``--dry-run`` runs the same code on the CPU with tiny models (fp32; the graphs stage checks that --cuda_graphs is
refused there, the sync stage runs without the debug mode): the plumbing, not the GPU.

    python benchmarks/gpu_first_checks.py chunked --out outputs/gpu_first
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Run as a script, its own folder heads sys.path, and benchmarks/kernels.py would shadow the `kernels` package that
# Transformers imports: the repository instead (python -m benchmarks.gpu_first_checks does the same).
sys.path[:] = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

GPT2_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50304, "n_positions": 1024}
GPT2_SMALL = {"n_layer": 4, "n_head": 4, "n_embd": 256, "vocab_size": 8192, "n_positions": 256}
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64, "n_positions": 32}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def gpt2(shape: dict, seed: int = 0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**shape, **NO_DROPOUT))


def relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def chunked(dry_run: bool) -> dict:
    """The plain and the chunked loss of one batch on the same weights: the loss and every gradient compared."""
    import torch

    from accel_ddp.tasks.chunked_loss import split_output_layer
    from accel_ddp.tasks.protocol import build_task

    device = "cpu" if dry_run else "cuda"
    shape = TINY if dry_run else GPT2_124M
    plain = gpt2(shape).to(device)
    split = gpt2(shape).to(device)
    split.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, shape["vocab_size"], (2 if dry_run else 8, shape["n_positions"]),
                           generator=torch.Generator().manual_seed(1)).to(device)
    losses = {}
    for name, model in (("plain", plain), ("chunked", split)):
        task = build_task("causal_lm")
        if name == "chunked":
            task.split_head = split_output_layer(model)
            task.compute_dtype = torch.bfloat16
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = task.training_loss(model, {"input_ids": tokens})
        (loss.value / loss.items).backward()
        losses[name] = (loss.value / loss.items).item()
    grads = dict(split.named_parameters())
    worst = max(((relative(grads[n].grad, p.grad), n) for n, p in plain.named_parameters() if p.grad is not None))
    loss_error = abs(losses["chunked"] - losses["plain"]) / abs(losses["plain"])
    return {"ok": loss_error < 1e-2 and worst[0] < 3e-2, "loss_plain": losses["plain"],
            "loss_chunked": losses["chunked"], "loss_rel_error": loss_error, "worst_grad_rel_error": worst[0],
            "worst_grad": worst[1]}


def _train(shape: dict, flags: dict, steps: int, dry_run: bool, output_dir: str, eval_blocks: int = 0):
    import torch

    from accel_ddp import TrainConfig, train
    from accel_ddp.data.in_memory import TokenBlocks

    length = shape["n_positions"]
    blocks = torch.randint(0, shape["vocab_size"], (8 * steps + eval_blocks, length),
                           generator=torch.Generator().manual_seed(2))
    options = dict(task="causal_lm", global_batch_size=8, max_steps=steps, lr=1e-3, warmup_steps=0, log_every=1000,
                   output_dir=output_dir, mixed_precision="no" if dry_run else "bf16")
    cfg = TrainConfig(**{**options, **flags})
    model = gpt2(shape)
    evaluated = TokenBlocks(blocks[8 * steps:]) if eval_blocks else None
    summary = train(cfg, model=model, train_dataset=TokenBlocks(blocks[:8 * steps]), eval_dataset=evaluated)
    return model, summary


def graphs(dry_run: bool) -> dict:
    """Eager and --cuda_graphs from the same weights and batches: the final weights compared, the replays counted."""
    from accel_ddp.step.graph import StepGraph
    from accel_ddp.util.validation import ConfigError

    shape = TINY if dry_run else GPT2_SMALL
    with tempfile.TemporaryDirectory() as work:
        # On the CPU the eager half only shows the run works (2 steps): the refusal is what is checked there.
        eager, _ = _train(shape, {}, 2 if dry_run else 12, dry_run, os.path.join(work, "eager"))
        if dry_run:  # no CUDA: the flag must be refused with its line; the eager half ran
            try:
                _train(shape, {"cuda_graphs": True}, 12, dry_run, os.path.join(work, "graphs"))
            except ConfigError as err:
                return {"ok": "needs a CUDA device" in str(err), "skipped": "no CUDA: --cuda_graphs refused",
                        "refusal": str(err)}
            return {"ok": False, "error": "--cuda_graphs was not refused on the CPU"}
        replays = []
        call = StepGraph.__call__

        def counted(self, batch):  # the StepGraph the step builds: its replay count after each step
            call(self, batch)
            replays.append(self.replays)

        StepGraph.__call__ = counted
        try:
            captured, _ = _train(shape, {"cuda_graphs": True}, 12, dry_run, os.path.join(work, "graphs"))
        finally:
            StepGraph.__call__ = call
    theirs = dict(captured.named_parameters())
    worst = max((relative(theirs[n].detach(), p.detach()), n) for n, p in eager.named_parameters())
    count = replays[-1] if replays else 0
    return {"ok": worst[0] <= 1e-2 and count > 0, "replays": count, "worst_weight_rel_error": worst[0],
            "worst_weight": worst[1]}


def compile_count(dry_run: bool) -> dict:
    """--compile_regions over 2 epochs with evaluations whose last batch is short: dynamo's compiled graphs."""
    import torch
    from torch._dynamo.utils import counters

    if dry_run:  # dynamo's graphs are the same on the eager backend; inductor on the CPU would take minutes
        compile_fn = torch.nn.Module.compile
        torch.nn.Module.compile = lambda self, *a, **k: compile_fn(self, *a, **{**k, "backend": "eager"})
    # 12 blocks on the GPU (124M's); 9 on the CPU, still more than dynamo's recompile limit of 8 that hid the defect
    shape = {**(TINY if dry_run else GPT2_124M), "n_layer": 9 if dry_run else 12}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        flags = {"compile_regions": True, "epochs": 2, "max_steps": None}
        _train({**shape, "n_positions": 64 if dry_run else 256}, flags, 3, dry_run, work, eval_blocks=11)
    graphs_compiled = counters["stats"]["unique_graphs"]
    return {"ok": 0 < graphs_compiled <= 3, "graphs": graphs_compiled, "recompile_limit": 8,
            "wall_sec": time.perf_counter() - started}


def sync(dry_run: bool) -> dict:
    """A run whose steps 4-8 run under torch.cuda.set_sync_debug_mode("error"): a sync inside them raises."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = {"done": 0}

    def window(optimizer, args, kwargs):
        steps["done"] += 1
        if not dry_run and steps["done"] in (3, 8):  # after the warm-up step(s); off before the run's end syncs
            torch.cuda.set_sync_debug_mode("error" if steps["done"] == 3 else "default")

    handle = register_optimizer_step_post_hook(window)
    try:
        with tempfile.TemporaryDirectory() as work:
            _train(TINY if dry_run else GPT2_SMALL, {}, 10, dry_run, work)
    except RuntimeError as err:
        return {"ok": False, "error": str(err).splitlines()[0][:300], "at_step": steps["done"] + 1}
    finally:
        handle.remove()
        if not dry_run:
            torch.cuda.set_sync_debug_mode("default")
    return {"ok": steps["done"] == 10, "steps": steps["done"], "checked_steps": "4-8",
            **({"skipped": "no CUDA: the steps ran without the sync debug mode"} if dry_run else {})}


STAGES = {"chunked": chunked, "graphs": graphs, "compile_count": compile_count, "sync": sync}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny models: the plumbing only")
    parser.add_argument("--out", default=str(REPO / "outputs" / "gpu_first"), help="folder for <stage>.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        result = STAGES[args.stage](args.dry_run)
    except Exception as err:  # noqa: BLE001 - a stage that breaks is a FAIL line with its error, not a traceback only
        result = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
    result = {"stage": args.stage, "dry_run": args.dry_run, "sec": round(time.perf_counter() - started, 1), **result}
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, f"{args.stage}.json").write_text(json.dumps(result, indent=1))
    word = "FAIL" if not result["ok"] else "SKIP" if "skipped" in result else "PASS"
    figures = {k: v for k, v in result.items() if k not in ("stage", "ok", "dry_run")}
    print(f"{word} {args.stage} {json.dumps(figures)}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
