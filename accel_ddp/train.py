"""The training entry point: ``main()`` for the CLI, ``train()`` for Python.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train.py --dataset digits

    from accel_ddp import TrainConfig, train
    summary = train(TrainConfig(epochs=3), model=my_model, train_dataset=ds, eval_dataset=ds_eval)
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import set_seed
from torch.utils.data import Dataset, Subset
from tqdm.auto import tqdm

from accel_ddp.checkpoint import export_weights
from accel_ddp.config import ConfigError, TrainConfig, parse_args
from accel_ddp.data import build_datasets, build_eval_loader, build_train_loader, steps_per_epoch
from accel_ddp.evaluate import evaluate
from accel_ddp.models import build_lr_scheduler, build_model, build_optimizer
from accel_ddp.tracking import RunRecorder, progress_bar

# Test hook: "STEP:RANK" makes that rank raise right after optimizer step STEP.
FAIL_ENV = "ACCEL_DDP_FAIL_AT_STEP"
DEBUG_MAX_STEPS = 10  # --debug: a handful of optimizer steps is enough to surface shape or sync bugs


class LaunchError(RuntimeError):
    """The processes did not form the world the launcher announced."""


def build_accelerator(cfg: TrainConfig) -> tuple[Accelerator, int, int]:
    """Join the process group and derive (per-device batch, accumulation) from the world size.

    Without a GPU we must ask for CPU ourselves: Accelerate only forms a gloo group for a
    torchrun launch when the script requests CPU; otherwise it would start N lone processes.
    """
    if cfg.debug:
        os.environ["ACCELERATE_DEBUG_MODE"] = "1"  # cross-rank shape checks on every collective
    cpu = not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    launched_world = int(os.environ.get("WORLD_SIZE", "1"))
    if state.num_processes != launched_world:
        raise LaunchError(
            f"the launcher started {launched_world} processes but they formed a group of "
            f"{state.num_processes}; launch with an accelerate config of distributed_type MULTI_GPU "
            "(see accelerate_configs/README.md), not MULTI_CPU without mpirun"
        )
    per_device, accumulation = cfg.batch_layout(state.num_processes)
    accelerator = Accelerator(
        cpu=cpu,
        gradient_accumulation_steps=accumulation,
        # Accelerate would otherwise step the schedule num_processes times per optimizer step.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed, non_blocking=not cpu),
    )
    return accelerator, per_device, accumulation


def _parse_fail_hook() -> tuple[int, int] | None:
    value = os.environ.get(FAIL_ENV)
    if not value:
        return None
    step, _, rank = value.partition(":")
    return int(step), int(rank or 0)


def _infer_num_classes(dataset: Dataset) -> int:
    if hasattr(dataset, "classes"):
        return len(dataset.classes)
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None and len(tensors) >= 2:
        return int(tensors[1].max()) + 1
    raise ConfigError("cannot tell the number of classes of train_dataset; pass model= built for it")


def _resolve_data(cfg: TrainConfig, accelerator: Accelerator, train_dataset, eval_dataset):
    """(train, eval or None, num_classes, input_shape) from the config or the caller's datasets."""
    if train_dataset is None:
        with accelerator.main_process_first():  # one download per machine
            bundle = build_datasets(
                cfg.dataset, cfg.data_dir, cfg.download, samples=cfg.synthetic_samples,
                shape=cfg.synthetic_shape, classes=cfg.synthetic_classes,
            )
        train_dataset, eval_dataset = bundle.train, bundle.eval
        num_classes, input_shape = bundle.num_classes, bundle.input_shape
    else:
        num_classes, input_shape = None, tuple(train_dataset[0][0].shape)
    if cfg.debug:  # a small subset: errors show up in seconds
        train_dataset = Subset(train_dataset, range(min(len(train_dataset), DEBUG_MAX_STEPS * cfg.global_batch_size)))
        if eval_dataset is not None:
            eval_dataset = Subset(eval_dataset, range(min(len(eval_dataset), 4 * cfg.global_batch_size)))
    return train_dataset, eval_dataset, num_classes, input_shape


def train(
    cfg: TrainConfig,
    model: torch.nn.Module | None = None,
    train_dataset: Dataset | None = None,
    eval_dataset: Dataset | None = None,
) -> dict[str, Any]:
    """Train on every rank of the current launch; return the summary (the same on every rank).

    ``model`` and the datasets default to those named in ``cfg``. Datasets yield ``(input,
    label)`` pairs; without ``eval_dataset`` no evaluation runs.
    """
    accelerator = None
    recorder = None
    try:
        accelerator, per_device_batch, accumulation = build_accelerator(cfg)
        recorder = RunRecorder(cfg.output_dir, accelerator.is_main_process)
        summary = _train_loop(cfg, accelerator, recorder, per_device_batch, accumulation,
                              model, train_dataset, eval_dataset)
        return summary
    finally:
        if recorder is not None:
            recorder.close()
        if accelerator is not None:
            accelerator.end_training()


def _train_loop(cfg, accelerator, recorder, per_device_batch, accumulation, model, train_dataset, eval_dataset):
    started = time.perf_counter()
    if cfg.debug:
        torch.autograd.set_detect_anomaly(True)
        torch.use_deterministic_algorithms(True, warn_only=True)
    set_seed(cfg.seed)  # same model init on every rank; DDP also broadcasts rank 0's weights
    train_dataset, eval_dataset, num_classes, input_shape = _resolve_data(cfg, accelerator, train_dataset, eval_dataset)
    if model is None:
        model = build_model(cfg.model, num_classes or _infer_num_classes(train_dataset), input_shape, cfg.hidden_size)

    num_workers = 0 if cfg.debug else cfg.num_workers
    train_loader = build_train_loader(train_dataset, per_device_batch, cfg.global_batch_size, num_workers)
    eval_loader = None
    if eval_dataset is not None:
        eval_loader = build_eval_loader(eval_dataset, cfg.eval_batch_size or 2 * per_device_batch, num_workers)

    steps_in_epoch = steps_per_epoch(len(train_dataset), cfg.global_batch_size)
    total_steps = cfg.max_steps or cfg.epochs * steps_in_epoch
    if cfg.debug:
        total_steps = min(total_steps, DEBUG_MAX_STEPS)
    num_epochs = math.ceil(total_steps / steps_in_epoch)

    optimizer = build_optimizer(cfg.optimizer, model, cfg.lr, cfg.weight_decay,
                                fused=accelerator.device.type == "cuda")
    scheduler = build_lr_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, total_steps)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)

    world = accelerator.num_processes
    run_facts = {
        "world_size": world,
        "global_batch_size": cfg.global_batch_size,
        "per_device_batch_size": per_device_batch,
        "grad_accum_steps": accumulation,
        "steps_per_epoch": steps_in_epoch,
        "total_steps": total_steps,
        "distributed_type": str(accelerator.distributed_type.value),
        "mixed_precision": accelerator.mixed_precision,
        "device": str(accelerator.device.type),
        "num_machines": int(os.environ.get("ACCELERATE_NUM_MACHINES", os.environ.get("GROUP_WORLD_SIZE", "1"))),
    }
    recorder.write_config({**cfg.to_dict(), "resolved": run_facts})
    fail_hook = _parse_fail_hook()

    # ---- the loop: micro_step = one forward/backward per rank; step = one optimizer step ----
    step = 0
    eval_metrics: dict[str, Any] = {}
    train_seconds = 0.0
    running_loss = torch.zeros((), device=accelerator.device)
    bar = progress_bar(total_steps, step, accelerator.is_local_main_process)
    for epoch in range(num_epochs):
        model.train()
        train_loader.set_epoch(epoch)  # new permutation each epoch, identical on every rank
        epoch_start = time.perf_counter()
        for inputs, labels in train_loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs).float(), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()  # no-op on accumulation micro-steps
                optimizer.zero_grad(set_to_none=True)
            running_loss += loss.detach() / accumulation
            if not accelerator.sync_gradients:
                continue
            scheduler.step()  # exactly once per optimizer step
            step += 1
            bar.update(1)
            if fail_hook is not None and fail_hook == (step, accelerator.process_index):
                raise RuntimeError(f"{FAIL_ENV}: injected failure on rank {accelerator.process_index} at step {step}")
            if step % cfg.log_every == 0 or step == total_steps:
                # Only here do we sync with the host: per-step .item() would stall the GPU.
                mean_loss = accelerator.reduce(running_loss, "mean").item() / _steps_since_log(step, cfg.log_every)
                running_loss.zero_()
                recorder.log({"step": step, "epoch": epoch, "loss": mean_loss, "lr": scheduler.get_last_lr()[0]})
                bar.set_postfix(loss=f"{mean_loss:.4f}")
            if eval_loader is not None and cfg.eval_every and step % cfg.eval_every == 0:
                eval_metrics = _evaluate_and_log(accelerator, model, eval_loader, recorder, step, epoch)
            if step >= total_steps:
                break
        train_seconds += time.perf_counter() - epoch_start
        if eval_loader is not None and not cfg.eval_every:
            eval_metrics = _evaluate_and_log(accelerator, model, eval_loader, recorder, step, epoch)
    bar.close()
    if eval_loader is not None and cfg.eval_every and step % cfg.eval_every != 0:
        eval_metrics = _evaluate_and_log(accelerator, model, eval_loader, recorder, step, num_epochs - 1)

    export_weights(accelerator, model, cfg.output_dir)
    summary = {
        **run_facts,
        "optimizer_steps": step,
        "epochs": num_epochs,
        "eval_accuracy": eval_metrics.get("eval_accuracy"),
        "eval_loss": eval_metrics.get("eval_loss"),
        "eval_samples": eval_metrics.get("eval_samples", 0),
        "train_samples_per_sec": step * cfg.global_batch_size / max(train_seconds, 1e-9),
        "train_seconds": train_seconds,
        "elapsed_sec": time.perf_counter() - started,
        "lr_scheduler_steps": scheduler.scheduler.last_epoch,
    }
    recorder.write_summary(summary)
    return summary


def _steps_since_log(step: int, log_every: int) -> int:
    return step % log_every or log_every


def _evaluate_and_log(accelerator, model, eval_loader, recorder, step, epoch) -> dict[str, Any]:
    metrics = evaluate(accelerator, model, eval_loader)
    recorder.log({"step": step, "epoch": epoch, **metrics})
    if accelerator.is_main_process:
        tqdm.write(f"step {step} epoch {epoch}: eval_loss {metrics['eval_loss']:.4f} "
                   f"eval_accuracy {metrics['eval_accuracy']:.4f} ({metrics['eval_samples']} samples)")
    return metrics


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: bad input is one line on stderr (from rank 0 only) and exit code 2."""
    try:
        train(parse_args(argv))
    except (ConfigError, LaunchError) as err:
        if _is_main_rank():
            print(f"accel_ddp: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
