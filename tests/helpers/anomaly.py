"""What tests of --on_anomaly share: the fault (a non-finite batch at optimizer step K on one rank, ``bad_step_mlp`` and
``install``), for tests/bad_steps/test_guard.py and tests/checkpoint/test_checkpoint_async.py; and the fused optimizers'
skipped step, importable without tests/conftest.py (which hides the GPUs): the GPU test runs it in a subprocess on
CUDA.
"""

from __future__ import annotations

import os
import signal

ARGS = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
        "--model", "tests.helpers.anomaly:bad_step_mlp", "--global_batch_size", "32", "--max_steps", "10",
        "--log_every", "2", "--lr", "0.01"]
BAD = (5, 1)  # optimizer step, rank
FAULT: dict = {}  # this rank's: the step and rank to poison, the scheduler that says which step runs


def bad_step_mlp(num_classes: int, input_shape: tuple[int, ...]):
    """A small mlp whose training output is nan during optimizer step FAULT["step"] on rank FAULT["rank"]."""
    from accel_ddp.models import build_mlp

    model = build_mlp(num_classes, input_shape, hidden_size=16)

    def poison(module, args, output):
        scheduler = FAULT.get("scheduler")
        if module.training and scheduler is not None and \
                (scheduler.last_epoch + 1, int(os.environ.get("RANK", "0"))) == (FAULT.get("step"), FAULT["rank"]):
            return output * FAULT.get("factor", float("nan"))
        return output

    model.register_forward_hook(poison)
    return model


def install(bad: tuple[int, int] | None = BAD, drop_update_at: int | None = None, kill_after: int | None = None,
            factor: float = float("nan")):
    """In a rank: multiply the output of step ``bad`` by ``factor``; drop the optimizer's step() call of
    ``drop_update_at`` (the reference); SIGKILL every rank right after optimizer step ``kill_after``."""
    import accel_ddp.optim.user as optim_user  # where setup's optimizer and schedule are built

    FAULT.update(step=bad[0] if bad else None, rank=bad[1] if bad else None, factor=factor)
    build_scheduler, build_optimizer = optim_user.build_lr_scheduler, optim_user.build_optimizer

    def scheduler_seen(*args, **kwargs):
        scheduler = FAULT["scheduler"] = build_scheduler(*args, **kwargs)
        if kill_after is not None:
            step = type(scheduler).step

            def step_then_die(self, *a, **k):
                step(self, *a, **k)
                if self.last_epoch == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)

            scheduler.__class__ = type("Dying", (type(scheduler),), {"step": step_then_die})
        return scheduler

    def optimizer_dropping(*args, **kwargs):
        optimizer = build_optimizer(*args, **kwargs)
        if drop_update_at is not None:
            calls, step = [0], type(optimizer).step

            def maybe_step(self, *a, **k):
                calls[0] += 1
                return None if calls[0] == drop_update_at else step(self, *a, **k)

            # A subclass, not an attribute: the LR scheduler wraps the bound method.
            optimizer.__class__ = type("Dropping", (type(optimizer),), {"step": maybe_step})
        return optimizer

    optim_user.build_lr_scheduler, optim_user.build_optimizer = scheduler_seen, optimizer_dropping



class _Guard:
    """decide() answers from a list of device bools: True = the step is bad."""

    def __init__(self, answers):
        self.answers = list(answers)

    def decide(self, norm):
        return self.answers.pop(0)


def fused_skip_equals_never_stepping(name: str, device: str = "cpu") -> bool:
    """A fused ``name`` optimizer through the guarded update, with steps 1 and 3 of 5 bad (nan gradients), ends
    bitwise where the same optimizer ends that never saw steps 1 and 3; Adam's step count is 3. On CUDA the
    guarded updates run under ``torch.cuda.set_sync_debug_mode("error")``: a host sync in them raises."""
    import torch

    from accel_ddp.optim.build import build_optimizer
    from accel_ddp.step.update import build_norm, guarded_update

    answers = [True, False, True, False, False]  # the first step skipped, and one mid-run
    draw = torch.Generator().manual_seed(1)
    shapes = [(8, 4), (8,), (2, 8), (2,)]
    grads = [[torch.randn(shape, generator=draw).to(device) for shape in shapes] for _ in answers]

    def run(guarded: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(device)
        optimizer = build_optimizer(name, model, lr=0.1, weight_decay=0.1, fused=True)
        params = list(model.parameters())
        flags = [torch.tensor(bad, device=device) for bad in answers]
        update = guarded_update(optimizer, params, build_norm(params), _Guard(flags)) if guarded else None
        for bad, step_grads in zip(answers, grads, strict=True):
            if bad and not guarded:  # the reference: that step's update never happened
                continue
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g * float("nan") if bad else g.clone()
            if not guarded:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                continue
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                update()
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        return [p.detach().cpu() for p in params], optimizer

    (skipped, fused), (reference, _) = run(True), run(False)
    steps_ok = name != "adamw" or all(int(s["step"]) == 3 for s in fused.state.values())  # skips did not count
    return steps_ok and all(torch.isfinite(p).all() and (p == q).all() for p, q in zip(skipped, reference,
                                                                                         strict=True))
