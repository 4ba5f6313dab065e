"""The fused optimizers' skipped step, for tests/test_anomalies.py, importable without tests/conftest.py (which
hides the GPUs): the GPU test runs it in a subprocess on CUDA.
"""

from __future__ import annotations


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

    from accel_ddp.optim import build_optimizer
    from accel_ddp.step import _guarded_update, build_norm

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
        update = _guarded_update(optimizer, params, build_norm(params), _Guard(flags)) if guarded else None
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
