"""accel_ddp/step/ (update.py, losses.py): one optimizer step with torch's arithmetic: the fused clip, backward and
update give the bits of torch's and Accelerate's own methods."""

from __future__ import annotations

import torch

from accel_ddp.step.update import build_clip
from tests.helpers.multiproc import run_ranks


def test_fused_clip_gives_torch_clip_grad_norm_bits():
    torch.manual_seed(0)
    for scale in (1e-3, 10.0):  # a norm under the limit (no change) and one over it
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((7, 5), (5,), (3, 7, 2), (4,))]
        twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, twin in zip(params[:-1], twins[:-1], strict=True):  # the last has no gradient
            p.grad = torch.randn_like(p) * scale
            twin.grad = p.grad.clone()
        norm = build_clip(params, 1.0)()
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(twins, 1.0))
        assert all(torch.equal(p.grad, t.grad) for p, t in zip(params[:-1], twins[:-1], strict=True))
        assert params[-1].grad is None


def test_backward_and_update_give_the_weights_of_accelerates_methods():
    """build_backward + build_update's fast path (Tensor.backward, torch optimizer, fused clip) against
    Accelerate's backward, clip_grad_norm_, step and zero_grad: the same bits. With accumulation,
    build_backward is Accelerate's (it divides the loss)."""
    def both_ways():
        from accelerate import Accelerator

        from accel_ddp.models import build_model
        from accel_ddp.optim.build import build_optimizer
        from accel_ddp.step.update import build_backward, build_update

        accelerator = Accelerator(cpu=True)
        assert build_backward(accelerator) is torch.Tensor.backward
        weights = []
        for fast in (True, False):
            torch.manual_seed(0)
            model = build_model("mlp", 3, (5,), 8)
            model, optimizer = accelerator.prepare(model, build_optimizer("adamw", model, 0.1, 0.01))
            update = build_update(accelerator, model, optimizer, max_grad_norm=0.5)
            assert update.__name__ == "update"  # one process, no fp16: the torch optimizer's own step
            data = torch.randn(16, 5), torch.randint(0, 3, (16,))
            for _ in range(3):
                loss = torch.nn.functional.cross_entropy(model(data[0]), data[1])
                if fast:
                    build_backward(accelerator)(loss)
                    update()
                else:
                    accelerator.backward(loss)
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                assert all(p.grad is None for p in model.parameters())
            weights.append([p.detach().clone() for p in model.parameters()])
        accelerator.gradient_state.plugin_kwargs["num_steps"] = 2  # accumulation: Accelerate divides the loss
        return build_backward(accelerator) == accelerator.backward and all(
            torch.equal(a, b) for a, b in zip(*weights, strict=True))

    assert run_ranks(both_ways, world_size=1) == [True]


def test_a_captured_accumulator_adds_each_loss_into_the_sums_inside_the_step_with_the_same_gradient():
    """``LossAccumulator(captured=True)`` (what TrainStep builds under --cuda_graphs, whose replays run no Python):
    each micro-step's loss is added into the running sums on the device as it is made, not kept for the log line; and
    a (sum, num_items) loss takes the general path (backpropagated / nominal, rescaled by the item count), whose
    gradient is the one-process shortcut's."""
    from accelerate.utils import DistributedType

    from accel_ddp.step.losses import LossAccumulator
    from accel_ddp.tasks.protocol import Loss

    class OneProcess:
        device, num_processes, distributed_type = torch.device("cpu"), 1, DistributedType.NO
        gradient_accumulation_steps, scaler, sync_gradients = 1, None, True

    sums, grads = [], []
    for captured in (False, True):
        losses = LossAccumulator(OneProcess(), 1, 4, captured=captured)
        model = torch.nn.Linear(3, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        losses.backward(Loss(model(torch.ones(3, 3)).sum(), torch.tensor(3)))  # a sum of 9 over 3 items
        losses.finish_step(model)
        sums.append(float(losses.running[0]))
        grads.append(model.weight.grad)
        assert losses.keep_losses is not captured
    assert sums == [0.0, 9.0]  # kept as the scalar it is (added at the log line), or added in the step
    assert torch.allclose(grads[0], grads[1]) and torch.allclose(grads[0], torch.ones(1, 3))
