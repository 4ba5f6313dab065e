"""The in-process stages of benchmarks/gpu_first_minutes.sh (the one GPU entry), one per call (the entry gives
each a timeout), the probes its launched checks run, and its one results file:

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

``probe nccl|fsdp OUT_JSON`` runs under ``accelerate launch`` for benchmarks/gpu_check.py (nccl_one_rank,
nccl_two_ranks, fsdp2_one_rank): rank 0 writes what it found, the check judges it. ``collect --out OUT`` writes the
entry's results file, ``OUT/gpu_first_minutes.json``, from the stages' lines and results.
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


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the error is the answer
        return "raises: " + " ".join(f"{type(err).__name__}: {err}".split())[:200]
    return "works"


def probe_nccl(accelerator) -> dict:
    """The group accel_ddp forms (NCCL on a GPU): barrier, broadcast, an all-reduce, and the preemption flag's gloo
    sub-group next to it (timed), then the default group again."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from accel_ddp.lifecycle.preemption import flag_group

    device = accelerator.device
    accelerator.wait_for_everyone()
    value = torch.full((4,), float(accelerator.process_index + 7), device=device)
    dist.broadcast(value, src=0)
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    group = flag_group(timedelta(seconds=60))  # what PreemptionWatcher uses
    flag = torch.ones(1, dtype=torch.int32)
    started = time.perf_counter()
    for _ in range(100):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    flag_ms = (time.perf_counter() - started) * 10  # per all-reduce
    total_after = torch.ones(1, device=device)
    dist.all_reduce(total_after)  # the default group still works after the gloo traffic
    return {"backend": dist.get_backend(), "device": str(device), "world_size": dist.get_world_size(),
            "broadcast_ok": bool((value == 7.0).all()), "all_reduce": float(total.item()),
            "all_reduce_after_flag": float(total_after.item()), "flag_group_backend": dist.get_backend(group),
            "flag_all_reduce_ms": round(flag_ms, 3)}


def probe_fsdp(accelerator) -> dict:
    """Under an FSDP2 launch: the mixed-precision policy accel_ddp's model really got, and whether the premises of
    accel_ddp's FSDP2 refusals still hold in this torch (fused SGD on DTensors, channels-last parameters, BatchNorm
    under a bf16 policy): each "raises: ..." or "works"."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from accel_ddp.models import build_model
    from accel_ddp.optim.build import build_optimizer, use_fused_optimizer

    plugin_policy = accelerator.state.fsdp_plugin.mixed_precision_policy
    model = build_model("mlp", num_classes=3, input_shape=(16,), hidden_size=32)
    optimizer = build_optimizer("adamw", model, 1e-3, 0.0, fused=use_fused_optimizer("adamw", "cuda", True))
    model, optimizer = accelerator.prepare(model, optimizer)
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None  # FSDPModule's, torch 2.14
    applied = getattr(state, "_mp_policy", None)
    device = accelerator.device

    def fused_sgd():
        layer = fully_shard(nn.Linear(8, 8).to(device))
        opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, fused=True)
        layer(torch.randn(4, 8, device=device)).sum().backward()
        opt.step()

    def channels_last():
        conv = nn.Conv2d(3, 8, 3).to(device).to(memory_format=torch.channels_last)
        fully_shard(conv)

    def batchnorm_bf16():
        net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).to(device)
        fully_shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        net(torch.randn(4, 3, 8, 8, device=device)).sum().backward()

    return {"distributed_type": str(accelerator.distributed_type.value), "is_fsdp2": accelerator.is_fsdp2,
            "mixed_precision": accelerator.mixed_precision,
            "plugin_policy": str(plugin_policy), "applied_policy": str(applied),
            "fused_sgd_on_dtensors": _outcome(fused_sgd), "channels_last_params": _outcome(channels_last),
            "batchnorm_under_bf16_policy": _outcome(batchnorm_bf16)}


def probe(mode: str, answer: str) -> None:
    """``gpu_first_checks.py probe nccl|fsdp OUT_JSON`` under ``accelerate launch``: rank 0 writes the answer, a figure
    that the check reading it judges."""
    from accel_ddp import exit_process
    from accel_ddp.assemble import build_world
    from accel_ddp.cli.args import parse_args

    accelerator, _, _ = build_world(parse_args(["--ddp_timeout", "120"]))
    got = {"nccl": probe_nccl, "fsdp": probe_fsdp}[mode](accelerator)
    if accelerator.is_main_process:
        Path(answer).write_text(json.dumps(got, indent=1), encoding="utf-8")
    accelerator.wait_for_everyone()
    exit_process(0)


def _results(out: Path, name: str):
    """What a stage's script wrote: ``OUT/<stage>.json``, else the JSON file in its folder ``OUT/<stage>/``."""
    found = [out / f"{name}.json", *sorted((out / name).glob("*.json"))]
    for path in found:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def collect(out: Path, dry_run: bool, budget: float) -> dict:
    """gpu_first_minutes.sh's one results file: each stage's line, share, seconds and log (its tail when it failed),
    the results its script wrote, embedded; the machine. At most 8 files come back from a device run: this one holds
    the run."""
    from benchmarks.common import machine_info, tail

    stages = []
    for row in (out / "stages.tsv").read_text().splitlines():
        name, share, seconds, line = row.split("\t", 3)
        log = out / f"{name}.log"
        record = {"name": name, "status": line.split()[0], "timed_out": " timed out after " in line,
                  "seconds": int(seconds), "share": int(share), "line": line, "log": str(log),
                  "results": _results(out, name)}
        if record["status"] == "FAIL":
            record["log_tail"] = tail(log, 60)
        stages.append(record)
    result = {"dry_run": dry_run, "budget_sec": budget, "machine": machine_info(gpu=not dry_run), "stages": stages}
    (out / "gpu_first_minutes.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


STAGES = {"chunked": chunked, "graphs": graphs, "compile_count": compile_count, "sync": sync}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:  # under `accelerate launch`, for benchmarks/gpu_check.py
        probe(*argv[1:3])
        return 0
    if argv[:1] == ["collect"]:
        parser = argparse.ArgumentParser(description="gpu_first_minutes.sh's results file")
        parser.add_argument("--out", required=True)
        parser.add_argument("--dry-run", action="store_true")
        parser.add_argument("--budget", type=float, required=True)
        args = parser.parse_args(argv[1:])
        collect(Path(args.out), args.dry_run, args.budget)
        return 0
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
