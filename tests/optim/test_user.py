"""accel_ddp/optim/user.py: the Python API's optimizer and LR scheduler (``train(optimizer=, lr_scheduler=)``),
checked before the data is read, built on the model's trainable parameters, said in the start-up block."""

from __future__ import annotations

import types

import pytest
import torch

from accel_ddp.config import TrainConfig
from accel_ddp.config.views import section_of
from accel_ddp.models import build_model
from accel_ddp.optim.user import OptimizerOptions, build_optimization, check_optimization
from accel_ddp.util.validation import ConfigError

StepLR = torch.optim.lr_scheduler.StepLR
CPU = types.SimpleNamespace(device=torch.device("cpu"), is_fsdp2=False,
                            distributed_type=types.SimpleNamespace(value="NO"))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)


def _options(**options) -> OptimizerOptions:
    """The optimizer's section of a config of ``options``, as assemble builds it."""
    return section_of(TrainConfig(**options), OptimizerOptions)


def _build(cfg: TrainConfig, model, accelerator, total_steps: int, *given):
    """``build_optimization`` as assemble calls it: the config's section, its warmup resolved for ``total_steps``."""
    return build_optimization(section_of(cfg, OptimizerOptions), model, accelerator, total_steps,
                              cfg.warmup_for(total_steps), *given)


def radam(groups):
    return torch.optim.RAdam(groups, lr=1e-3)


def step_lr(optimizer):
    return StepLR(optimizer, step_size=2, gamma=0.5)


def test_a_function_of_the_groups_and_a_function_of_the_optimizer_replace_the_built_ins():
    model = _mlp()
    built = _build(TrainConfig(weight_decay=0.05), model, CPU, 10, radam, step_lr)
    assert isinstance(built.optimizer, torch.optim.RAdam) and isinstance(built.scheduler, StepLR)
    assert [g["weight_decay"] for g in built.optimizer.param_groups] == [0.05, 0.0]  # the split, --weight_decay
    assert built.name == "RAdam (train(optimizer=...))" and not built.schedule_from_flags
    assert built.lines == {
        "optimizer": "RAdam (train(optimizer=...)), its own learning rate, weight decay 0.05 (none for biases and "
                     "norms)",
        "learning rate": "StepLR (train(lr_scheduler=...)), stepped once per optimizer step, from 0.001"}
    alone = _build(TrainConfig(warmup_steps=2), model, CPU, 10, radam)  # the built-in schedule on it
    assert alone.schedule_from_flags and alone.scheduler.get_last_lr() == [pytest.approx(1e-3 / 3)] * 2
    assert alone.lines["learning rate"] == "the optimizer's 0.001 after 2 warmup steps, then --lr_schedule cosine"


def test_an_optimizer_already_built_on_the_model_and_a_scheduler_on_it_are_used_as_they_are():
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scheduler = StepLR(optimizer, step_size=3)
    check_optimization(_options(), model, optimizer, scheduler)
    built = _build(TrainConfig(), model, CPU, 10, optimizer, scheduler)
    assert built.optimizer is optimizer and built.scheduler is scheduler
    assert "its own parameter groups" in built.lines["optimizer"]


@pytest.mark.parametrize("cfg, model, optimizer, lr_scheduler, words", [
    ({}, None, "adam", None, "train(optimizer=...) got str: give a function of the parameter groups returning a "
                             "torch.optim.Optimizer, or an optimizer built on model.parameters()"),
    ({}, None, torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), None,
     "train(optimizer=...) got an optimizer already built, but no model= to train: give the model its parameters "
     "belong to, or a function of the parameter groups instead"),
    ({"optimizer": "sgd", "lr": 0.1}, _mlp(), radam, None,
     "--optimizer sgd, --lr 0.1 with train(optimizer=...): they do nothing there (set it on your optimizer); drop "
     "them"),
    ({"optimizer_kwargs": '{"eps": 1e-6}'}, _mlp(), radam, None,
     "--optimizer_kwargs {\"eps\": 1e-6} with train(optimizer=...): it does nothing there"),
    ({"weight_decay": 0.1}, _mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1), None,
     "--weight_decay 0.1 with train(optimizer=...): it does nothing there"),
    ({"warmup_steps": 5, "lr_schedule": "linear"}, None, None, step_lr,
     "--warmup_steps 5, --lr_schedule linear with train(lr_scheduler=...): they do nothing there (your scheduler "
     "sets the LR); drop them"),
    ({"warmup_ratio": 0.1}, None, None, step_lr, "--warmup_ratio 0.1 with train(lr_scheduler=...)"),
    ({}, None, None, 0.5, "train(lr_scheduler=...) got float: give a function of the optimizer returning a "
                          "torch.optim.lr_scheduler.LRScheduler"),
    ({"optimizer": "lamb"}, None, None, None, "unknown optimizer 'lamb'; choose one of"),
    ({"optimizer": "tests.optim.test_user:radam", "lr": 0.1}, None, None, None,
     "--lr 0.1 with --optimizer tests.optim.test_user:radam: it does nothing there (set lr in the function, or pass "
     "it with --optimizer_kwargs '{\"lr\": ...}'); drop it"),
])
def test_what_cannot_work_or_would_do_nothing_is_refused_before_the_data_in_one_line(cfg, model, optimizer,
                                                                                     lr_scheduler, words):
    with pytest.raises(ConfigError) as err:
        check_optimization(_options(**cfg), model, optimizer, lr_scheduler)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


@pytest.mark.parametrize("optimizer, lr_scheduler, words", [
    (lambda groups: groups, None, "train(optimizer=...): the function returned list, not a torch.optim.Optimizer"),
    (lambda groups: torch.optim.SGD(_mlp().parameters(), lr=0.1), None,
     "train(optimizer=...): 6 of the optimizer's 6 parameters are not trainable parameters of the model Sequential"),
    (radam, lambda optimizer: 3, "train(lr_scheduler=...): got int, not a torch.optim.lr_scheduler.LRScheduler"),
    (radam, lambda optimizer: torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer),
     "train(lr_scheduler=...): ReduceLROnPlateau steps on a metric"),
    (radam, lambda optimizer: StepLR(radam(_mlp().parameters()), 2),
     "train(lr_scheduler=...): the StepLR is built on another optimizer"),
])
def test_what_the_functions_return_is_checked_in_one_line(optimizer, lr_scheduler, words):
    with pytest.raises(ConfigError) as err:
        _build(TrainConfig(), _mlp(), CPU, 10, optimizer, lr_scheduler)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def kwargs_radam(groups, lr=1e-3, **kwargs):
    return torch.optim.RAdam(groups, lr=lr, **kwargs)


def test_a_functions_learning_rate_is_its_own_and_its_keywords_may_set_it():
    cfg = TrainConfig(optimizer="tests.optim.test_user:kwargs_radam", optimizer_kwargs={"lr": 0.02})
    check_optimization(section_of(cfg, OptimizerOptions), None, None, None)
    built = _build(cfg, _mlp(), CPU, 10)
    assert built.optimizer.defaults["lr"] == 0.02 and built.name == "tests.optim.test_user:kwargs_radam"
    assert built.lines == {"learning rate": "the optimizer's 0.02 after 0 warmup steps, then --lr_schedule cosine"}
    with pytest.raises(ConfigError, match="--optimizer_kwargs sets 'lr': use --lr"):  # a class takes --lr
        TrainConfig(optimizer="radam", optimizer_kwargs={"lr": 0.02})


def test_the_examples_optimizer_and_schedule_are_what_docs_optimizers_md_says():
    """examples/optimizers.py (its launch is not run by the suite): RAdam with decoupled decay, StepLR by 50."""
    built = _build(TrainConfig(optimizer="examples.optimizers:radam_decoupled", weight_decay=0.01),
                               _mlp(), CPU, 200)
    assert isinstance(built.optimizer, torch.optim.RAdam) and built.optimizer.defaults["decoupled_weight_decay"]
    assert [g["weight_decay"] for g in built.optimizer.param_groups] == [0.01, 0.0]
    from examples.optimizers import radam_decoupled, step_lr

    scheduler = _build(TrainConfig(), _mlp(), CPU, 200, radam_decoupled, step_lr).scheduler
    assert isinstance(scheduler, StepLR) and (scheduler.step_size, scheduler.gamma) == (50, 0.5)


def test_muon_under_fsdp_is_refused_in_one_line():
    fsdp = types.SimpleNamespace(device=torch.device("cpu"), is_fsdp2=True,
                                 distributed_type=types.SimpleNamespace(value="FSDP"))
    with pytest.raises(ConfigError, match=r"^--optimizer muon is not supported under FSDP \(its state is two "
                                          r"optimizers'\); use DDP, or another optimizer$"):
        _build(TrainConfig(optimizer="muon"), _mlp(), fsdp, 10)
