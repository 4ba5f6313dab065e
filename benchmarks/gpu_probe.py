"""Probes for benchmarks/gpu_check.py, run under ``accelerate launch``; rank 0 writes a JSON answer.

    gpu_probe.py nccl OUT_JSON   the group accel_ddp forms (NCCL on a GPU): barrier, broadcast, an NCCL
                                 all-reduce, and the preemption flag's gloo sub-group next to it
    gpu_probe.py fsdp OUT_JSON   under an FSDP2 launch: the mixed-precision policy accel_ddp's model really
                                 got, and whether the premises of accel_ddp's FSDP2 refusals still hold in
                                 this torch (fused SGD on DTensors, channels-last parameters, BatchNorm under
                                 a bf16 policy): each "raises: ..." or "works"

Each answer is a figure, not a verdict: gpu_check.py decides what passes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from accel_ddp import exit_process  # noqa: E402
from accel_ddp.assemble import build_world  # noqa: E402
from accel_ddp.cli.args import parse_args  # noqa: E402
from accel_ddp.lifecycle.preemption import flag_group  # noqa: E402
from accel_ddp.models import build_model
from accel_ddp.optim.build import build_optimizer, use_fused_optimizer  # noqa: E402


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the error is the answer
        return "raises: " + " ".join(f"{type(err).__name__}: {err}".split())[:200]
    return "works"


def probe_nccl(accelerator) -> dict:
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
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    accelerator, _, _ = build_world(parse_args(["--ddp_timeout", "120"]))
    answer = {"nccl": probe_nccl, "fsdp": probe_fsdp}[mode](accelerator)
    if accelerator.is_main_process:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(answer, fh, indent=1)
    accelerator.wait_for_everyone()
    exit_process(0)


if __name__ == "__main__":
    main()
