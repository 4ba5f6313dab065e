"""Your own optimizer and learning-rate schedule (docs/optimizers.md).

On the command line, a function of the parameter groups:

    python train.py --optimizer examples.optimizers:radam_decoupled --output_dir outputs/radam_fn

From Python, the same function and a schedule of your own (a function of the optimizer), checkpointed and resumed
like the built-in ones:

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/optimizers.py
"""

from __future__ import annotations

import torch


def radam_decoupled(groups, **kwargs):
    """RAdam with decoupled weight decay (AdamW's), on the groups the run gives: matrices and kernels first (with
    --weight_decay when it is set), then biases and norms (no decay). --optimizer_kwargs arrive as ``kwargs``."""
    return torch.optim.RAdam(groups, lr=3e-3, decoupled_weight_decay=True, **kwargs)


def step_lr(optimizer):
    """The LR halved every 50 optimizer steps (stepped once per optimizer step, whatever the world size)."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)


if __name__ == "__main__":
    from accelerate import PartialState

    from accel_ddp import TrainConfig, train

    cfg = TrainConfig(dataset="digits", epochs=6, checkpointing_steps="50", output_dir="outputs/own_optimizer")
    summary = train(cfg, optimizer=radam_decoupled, lr_scheduler=step_lr)
    if PartialState().is_main_process:
        print(f"{summary['optimizer']}: {summary['optimizer_steps']} steps, eval accuracy "
              f"{summary['eval_accuracy']:.3f}, lr_scheduler_steps {summary['lr_scheduler_steps']}")
