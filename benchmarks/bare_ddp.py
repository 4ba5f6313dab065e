"""The bare DDP loop: plain ``torch.distributed`` + ``DistributedDataParallel``, no Accelerate, nothing extra.

The baseline for accel_ddp's per-step cost (``tax.py``): the same model, optimizer (built by
accel_ddp's own ``build_optimizer``, so the same parameter groups and the same fused or
multi-tensor implementation), malloc thresholds (on the CPU pinned as accel_ddp pins them,
``--glibc_default`` to leave them), activation kernels (accel_ddp's ``fuse_activations``;
``--model_kernels`` keeps the model's own), per-rank batch and samples, with the data already on the
device as normalised float tensors, so that each step is a gather, forward, loss, backward (DDP's
all-reduce), optional clipping, the optimizer step and ``zero_grad``. No logging, no LR schedule,
no preemption flag, no timers beyond one clock reading per step: the fastest loop a user could
write by hand. Launch it the way accel_ddp is launched (``tax.py`` does):

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml benchmarks/bare_ddp.py \
        --workload mlp --epochs 15 --global_batch_size 64 --max_grad_norm 1.0 --results_json /tmp/bare.json

Workloads: ``mlp`` (the README's main run: scikit-learn digits, MLP 64-256-256-10), ``cnn``
(``mnist_cnn`` on the MNIST split of ``common.py``) and ``lm`` (a GPT-2 from a Transformers config
on the packed token blocks accel_ddp's ``--task causal_lm --packing`` makes of a text folder; the
mean next-token cross-entropy, as a hand-written loop computes it). Each epoch trains on the
permutation accel_ddp's device loader draws (``epoch_order``): the same samples per step as accel_ddp.

Timing is what accel_ddp's ``EpochTimer`` measures: per epoch, from just before the epoch's
permutation to the last optimizer step, on the host clock, and the process's CPU time (all
threads). On CUDA the queue is drained before each epoch's clock starts (accel_ddp's evaluation
between epochs does the same); the clock then stops without a sync, as accel_ddp's does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel_ddp.data import build_datasets, epoch_order, steps_per_epoch  # noqa: E402  (no Accelerate import)
from accel_ddp.models import build_model  # noqa: E402
from accel_ddp.optim.build import build_optimizer, use_fused_optimizer  # noqa: E402
from accel_ddp.tracking.startup import process_age  # noqa: E402
from accel_ddp.transforms.fused_activations import fuse_activations  # noqa: E402
from accel_ddp.util.host_memory import keep_freed_host_memory  # noqa: E402
from benchmarks.common import exit_now  # noqa: E402


def load(args, device: torch.device):
    """(train inputs on the device: normalised float32 images or token blocks, labels on the device or None, the
    model, its loss on a batch)."""
    if args.workload == "lm":
        from accel_ddp.data.hf import HFSource
        from accel_ddp.data.text import TextOptions, build_text
        from accel_ddp.models import build_transformers_model

        options = TextOptions(args.tokenizer, max_length=args.max_length, packing=True, labels=False)
        bundle, tokenizer = build_text(args.data_dir, HFSource(), options)
        model = build_transformers_model("causal_lm", config_file=args.model_config, tokenizer=tokenizer,
                                         max_length=args.max_length)
        tokens = bundle.train.inputs.to(device)  # TokenBlocks (blocks, max_length): packed, no padding

        def next_token_loss(model, ids, _):  # labels shifted, not logits: no copy of the (B, T, vocab) logits
            logits = model(input_ids=ids, use_cache=False).logits  # as accel_ddp runs it: no key/value cache
            labels = F.pad(ids[:, 1:], (0, 1), value=-100)
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

        return tokens, None, model, next_token_loss
    if args.workload == "mlp":
        bundle = build_datasets("digits", "data", False)
        model = build_model("mlp", bundle.num_classes, bundle.input_shape, hidden_size=256)
    else:
        from benchmarks.common import mnist_split

        bundle = mnist_split("", False)
        model = build_model("mnist_cnn", bundle.num_classes, bundle.input_shape)
    data = bundle.train.to(device)
    return data.transform(data.inputs), data.labels, model, lambda model, x, y: F.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("mlp", "cnn", "lm"), default="mlp")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--global_batch_size", type=int, default=64)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="0 = no clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results_json", default=None)
    parser.add_argument("--save_weights", default=None, help="rank 0 writes the final weights here (parity.py)")
    parser.add_argument("--data_dir", help="lm: the folder examples/pydoc_text.py lm wrote")
    parser.add_argument("--tokenizer", help="lm: its tokenizer folder")
    parser.add_argument("--model_config", help="lm: a Transformers config (examples/configs/tiny_gpt2.json)")
    parser.add_argument("--max_length", type=int, default=128, help="lm: tokens per packed block")
    parser.add_argument("--model_kernels", action="store_true",
                        help="keep the model's own activation modules (tax.py's 'kernels' pair); default: accel_ddp's "
                             "one-kernel tanh GELU, as accel_ddp's --fused_kernels does")
    parser.add_argument("--glibc_default", action="store_true",
                        help="leave glibc's moving malloc thresholds as a hand-written loop gets them (tax.py's "
                             "'malloc' pair); default: pinned on the CPU, as accel_ddp does")
    args = parser.parse_args()
    started = time.perf_counter() - (process_age() or 0.0)  # this process's start, as accel_ddp's startup_sec

    cuda = torch.cuda.is_available()
    if not cuda and not args.glibc_default:  # as accel_ddp's ranks on the CPU (accel_ddp/util/host_memory.py)
        keep_freed_host_memory()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    inputs, labels, model, loss_of = load(args, device)
    model = model.to(device)
    if not args.model_kernels:
        fuse_activations(model)  # as accel_ddp's --fused_kernels (the default)
    fused = use_fused_optimizer(args.optimizer, device.type)  # as accel_ddp decides
    optimizer = build_optimizer(args.optimizer, model, args.lr, 0.0, fused=fused)
    if world > 1:  # as Accelerate: one process trains the plain model (a 1-rank DDP would copy every gradient)
        model = DDP(model, device_ids=[local_rank] if cuda else None, gradient_as_bucket_view=True)
    params = list(model.parameters())
    per_rank = args.global_batch_size // world
    steps = steps_per_epoch(len(inputs), args.global_batch_size)

    epochs, first_step_at = [], None
    for epoch in range(args.epochs):
        if cuda:
            torch.cuda.synchronize()
        epoch_start, epoch_cpu = time.perf_counter(), time.process_time()
        order = epoch_order(len(inputs), steps * args.global_batch_size, args.seed, epoch)
        indices = order.view(steps, world, per_rank)[:, rank].to(device, non_blocking=True)
        for step in range(steps):
            index = indices[step]
            x = torch.index_select(inputs, 0, index)
            loss = loss_of(model, x, None if labels is None else torch.index_select(labels, 0, index))
            loss.backward()
            if args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if first_step_at is None:
                first_step_at = time.perf_counter()
        epochs.append({"epoch": epoch, "steps": steps, "seconds": time.perf_counter() - epoch_start,
                       "cpu_seconds": time.process_time() - epoch_cpu})
    if cuda:
        torch.cuda.synchronize()
    startup = torch.tensor([first_step_at - started], dtype=torch.float64, device=device)
    dist.all_reduce(startup, op=dist.ReduceOp.MAX)
    if rank == 0 and args.results_json:
        Path(args.results_json).write_text(json.dumps({
            "world_size": world, "global_batch_size": args.global_batch_size, "epochs": epochs,
            "startup_sec": startup.item(), "final_loss": loss.item(),
        }))
    if rank == 0 and args.save_weights:  # the plain model's keys, as accel_ddp's model.safetensors
        from safetensors.torch import save_model

        save_model(model.module if world > 1 else model, args.save_weights)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # past the gloo teardown race at finalization (common.exit_now)
