"""accel_ddp/optim/build.py: the optimizer (parameter groups, fused or multi-tensor kernels) and the LR schedule."""

from __future__ import annotations

import math
import re

import pytest
import torch

from accel_ddp.models import build_model
from accel_ddp.optim.build import build_lr_scheduler, build_optimizer, lr_multiplier, use_fused_optimizer
from accel_ddp.util.validation import ConfigError


def test_fused_optimizer_is_requested():
    model = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    assert build_optimizer("adamw", model, lr=1e-3, weight_decay=0.0, fused=True).defaults["fused"] is True
    unfused = build_optimizer("adamw", model, lr=1e-3, weight_decay=0.0, fused=False)
    assert not unfused.defaults.get("fused") and unfused.defaults["foreach"] is True  # multi-tensor on the CPU
    assert build_optimizer("sgd", model, lr=1e-3, weight_decay=0.0, fused=True).defaults["fused"] is True


def test_fused_kernels_only_where_they_run():
    """Fused on CUDA and the CPU, except SGD under FSDP2 (no DTensor rule for aten._fused_sgd_ in torch 2.14):
    foreach there and on other devices."""
    for device in ("cuda", "cpu"):
        assert use_fused_optimizer("adamw", device) and use_fused_optimizer("sgd", device)
        assert use_fused_optimizer("adamw", device, fsdp2=True)
        assert not use_fused_optimizer("sgd", device, fsdp2=True)
    assert not use_fused_optimizer("adamw", "mps") and not use_fused_optimizer("sgd", "xpu")


def test_biases_and_norms_get_no_weight_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    model[2].weight.requires_grad_(False)  # frozen: in no group
    for name in ("sgd", "adamw"):
        decay, no_decay = build_optimizer(name, model, lr=0.1, weight_decay=0.05).param_groups
        assert [tuple(p.shape) for p in decay["params"]] == [(6, 4)] and decay["weight_decay"] == 0.05
        assert [tuple(p.shape) for p in no_decay["params"]] == [(6,), (6,), (6,), (2,)]
        assert no_decay["weight_decay"] == 0.0
    with pytest.raises(ConfigError, match=r"unknown optimizer 'lamb'; choose one of adadelta, adafactor, adagrad, "
                       r"adam, .*radam, rmsprop, rprop, sgd \(torch.optim of torch .*, any case\), or give "
                       r"'pkg.module:function'$"):
        build_optimizer("lamb", model, lr=0.1, weight_decay=0.0)


def test_warmup_is_linear_then_each_schedule_decays_as_named():
    # Warmup: step s of w gets (s + 1) / (w + 1) of the peak, never 0 and never the peak itself.
    assert [lr_multiplier(s, "cosine", 3, 13) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(8, "linear", 3, 13) == 0.5  # halfway through the 10 decay steps
    assert lr_multiplier(8, "cosine", 3, 13) == pytest.approx(0.5)
    assert lr_multiplier(13, "linear", 3, 13) == 0.0 and lr_multiplier(13, "cosine", 3, 13) == 0.0
    assert lr_multiplier(20, "cosine", 3, 13) == 0.0  # past the end: held at 0, never back up
    assert lr_multiplier(5, "cosine", 0, 10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert {lr_multiplier(s, "constant", 2, 10) for s in range(2, 12)} == {1.0}


def test_the_scheduler_steps_the_lr_of_every_group_once_per_call():
    model = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    optimizer = build_optimizer("sgd", model, lr=0.2, weight_decay=0.01)
    scheduler = build_lr_scheduler(optimizer, "linear", warmup_steps=1, total_steps=5)
    seen = []
    for _ in range(6):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert seen == [[pytest.approx(0.2 * lr_multiplier(s, "linear", 1, 5))] * 2 for s in range(6)]
    assert seen[0] == [pytest.approx(0.1)] * 2 and seen[5] == [0.0, 0.0]


def test_an_unknown_schedule_is_refused_when_built_not_at_the_first_step():
    model = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    with pytest.raises(ConfigError, match="unknown lr schedule 'step'; choose constant, linear or cosine"):
        build_lr_scheduler(build_optimizer("sgd", model, 0.1, 0.0), "step", warmup_steps=0, total_steps=10)


# ----------------------------------------------------------------------------- --optimizer NAME, --optimizer_kwargs

NAMED = ["adamw", "adam", "sgd", "rmsprop", "adagrad", "adafactor", "nadam", "radam", "muon"]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)


def _steps(model, optimizer, scheduler=None, count: int = 3) -> float:
    """``count`` full-batch steps on a fixed batch; the last loss."""
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=generator), torch.randint(0, 3, (32,), generator=generator)
    for _ in range(count):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    return float(loss.detach())


@pytest.mark.parametrize("name", NAMED)
def test_every_named_optimizer_is_its_torch_class_in_any_case_and_trains(name):
    from accel_ddp.config import TrainConfig
    from accel_ddp.optim.build import optimizer_classes

    assert TrainConfig(optimizer=name.upper()).optimizer == name  # the flag is case-insensitive
    model = _mlp()
    optimizer = build_optimizer(name, model, lr=1e-2, weight_decay=0.0, fused=True)
    expected = "MuonWithAdamW" if name == "muon" else optimizer_classes()[name].__name__
    assert type(optimizer).__name__ == expected
    first = _steps(model, optimizer, count=1)
    assert _steps(model, optimizer, count=20) < first  # it trains: the loss falls


def test_fused_or_foreach_where_the_signature_has_them_and_the_kernel_was_measured():
    model = _mlp()
    kernels = {name: {k: build_optimizer(name, model, 1e-3, 0.0, fused=True).defaults.get(k)
                      for k in ("fused", "foreach")} for name in ("adamw", "adam", "sgd", "radam", "adagrad", "rprop")}
    assert kernels["adamw"]["fused"] and kernels["adam"]["fused"] and kernels["sgd"]["fused"]
    assert kernels["radam"] == {"fused": None, "foreach": True}  # RAdam has no fused kernel
    assert kernels["adagrad"] == {"fused": None, "foreach": True}  # fused: CPU-only and unmeasured
    assert kernels["rprop"]["foreach"] is True
    asked = build_optimizer("adagrad", model, 1e-3, 0.0, fused=True, kwargs={"fused": True})
    assert asked.defaults["fused"] is True and not asked.defaults.get("foreach")  # the keywords choose


def test_sgd_keeps_nesterov_momentum_and_adamw_its_defaults_unless_the_keywords_say_otherwise():
    model = _mlp()
    sgd = build_optimizer("sgd", model, 0.1, 0.0)
    assert (sgd.defaults["momentum"], sgd.defaults["nesterov"]) == (0.9, True)
    plain = build_optimizer("sgd", model, 0.1, 0.0, kwargs={"momentum": 0.5, "nesterov": False})
    assert (plain.defaults["momentum"], plain.defaults["nesterov"]) == (0.5, False)
    adamw = build_optimizer("adamw", model, 0.1, 0.0)
    assert adamw.defaults["betas"] == (0.9, 0.999) and adamw.defaults["eps"] == 1e-8
    tuned = build_optimizer("adamw", model, 0.1, 0.0, kwargs={"betas": [0.9, 0.95]})  # JSON's list: a tuple
    assert tuned.defaults["betas"] == (0.9, 0.95)


def test_adamw_and_sgd_train_exactly_as_before_the_names_were_opened():
    """The two optimizers of before, built as build_optimizer built them, end with the same bits."""
    for name, make in (("adamw", lambda g: torch.optim.AdamW(g, lr=1e-2, fused=True)),
                       ("sgd", lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, nesterov=True, fused=True))):
        ours, theirs = _mlp(), _mlp()
        _steps(ours, build_optimizer(name, ours, 1e-2, 0.01, fused=True), count=5)
        decay = [p for p in theirs.parameters() if p.ndim >= 2]
        rest = [p for p in theirs.parameters() if p.ndim < 2]
        _steps(theirs, make([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]), count=5)
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)), name


@pytest.mark.parametrize("kwargs, weight_decay, words", [
    ({"betaz": [0.9, 0.95]}, 0.0, "--optimizer_kwargs: RAdam takes no keyword 'betaz'; it takes betas, eps, "
                                  "decoupled_weight_decay, foreach, maximize, capturable, differentiable"),
    ({"betas": [2, 0.9]}, 0.0, "--optimizer radam refused its options {'betas': (2, 0.9)} (Invalid beta parameter "
                               "at index 0: 2); fix --optimizer_kwargs"),
])
def test_a_bad_keyword_or_value_is_one_line(kwargs, weight_decay, words):
    with pytest.raises(ConfigError) as err:
        build_optimizer("radam", _mlp(), 1e-3, weight_decay, kwargs=kwargs)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_what_the_loop_cannot_step_and_a_weight_decay_the_optimizer_lacks_are_refused():
    with pytest.raises(ConfigError, match="--optimizer lbfgs cannot be used here: its step re-evaluates the model"):
        build_optimizer("lbfgs", _mlp(), 1e-3, 0.0)
    with pytest.raises(ConfigError, match="--weight_decay 0.1 with --optimizer rprop: Rprop has no weight decay"):
        build_optimizer("rprop", _mlp(), 1e-3, 0.1)


@pytest.mark.parametrize("value, words", [
    ('{"betas": [0.9', "--optimizer_kwargs '{\"betas\": [0.9' is not JSON"),
    ("[0.9, 0.95]", "--optimizer_kwargs must be a JSON object of keyword arguments"),
    ('{"lr": 0.1}', "--optimizer_kwargs sets 'lr': use --lr"),
    ('{"weight_decay": 0.1}', "--optimizer_kwargs sets 'weight_decay': use --weight_decay"),
])
def test_bad_optimizer_kwargs_are_refused_by_the_config(value, words):
    from accel_ddp.config import TrainConfig

    with pytest.raises(ConfigError, match=re.escape(words)):
        TrainConfig(optimizer_kwargs=value)


def test_optimizer_kwargs_from_yaml_or_python_are_kept_as_json():
    from accel_ddp.config import TrainConfig

    assert TrainConfig(optimizer_kwargs={"betas": [0.9, 0.95]}).optimizer_kwargs == '{"betas": [0.9, 0.95]}'


# ----------------------------------------------------------------------------- --optimizer pkg.module:function

def build_radam(groups, **kwargs):
    """``--optimizer tests.optim.test_build:build_radam``: RAdam on the groups it is given."""
    return torch.optim.RAdam(groups, lr=5e-3, **kwargs)


def not_an_optimizer(groups):
    return groups


def test_a_function_gets_the_groups_and_the_keywords_and_returns_the_optimizer():
    model = _mlp()
    optimizer = build_optimizer("tests.optim.test_build:build_radam", model, 1e-3, 0.0, kwargs={"betas": [0.8, 0.9]})
    assert isinstance(optimizer, torch.optim.RAdam) and optimizer.defaults["betas"] == (0.8, 0.9)
    decay, no_decay = optimizer.param_groups
    assert [tuple(p.shape) for p in decay["params"]] == [(8, 4), (8, 8), (3, 8)]
    assert decay["weight_decay"] == 0 and no_decay["weight_decay"] == 0.0  # RAdam's own 0; none for biases
    with_decay = build_optimizer("tests.optim.test_build:build_radam", model, 1e-3, 0.05)
    assert [g["weight_decay"] for g in with_decay.param_groups] == [0.05, 0.0]


@pytest.mark.parametrize("name, words", [
    ("tests.no_such_module:build", "--optimizer tests.no_such_module:build: cannot import module "
                                   "'tests.no_such_module'"),
    ("tests.optim.test_build:missing",
     "--optimizer tests.optim.test_build:missing: module 'tests.optim.test_build' has no function 'missing'"),
    ("tests.optim.test_build:not_an_optimizer",
     "--optimizer tests.optim.test_build:not_an_optimizer returned list, not a torch.optim.Optimizer"),
])
def test_a_function_that_does_not_import_or_returns_no_optimizer_is_one_line(name, words):
    with pytest.raises(ConfigError) as err:
        build_optimizer(name, _mlp(), 1e-3, 0.0)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_the_function_is_checked_against_the_keywords_before_anything_is_built():
    from accel_ddp.optim.build import check_optimizer

    with pytest.raises(ConfigError, match=r"--optimizer tests.optim.test_build:not_an_optimizer cannot be called "
                                          r"with the parameter groups and --optimizer_kwargs \{\"eps\": 1\}"):
        check_optimizer("tests.optim.test_build:not_an_optimizer", {"eps": 1})
    with pytest.raises(ConfigError, match="RAdam takes no keyword 'momentum'"):
        check_optimizer("radam", {"momentum": 0.9})
    check_optimizer("tests.optim.test_build:build_radam", {"eps": 1e-6})  # good: no error


@pytest.mark.parametrize("flags, words", [
    (["--optimizer", "Lamb"], "accel_ddp: error: unknown optimizer 'lamb'; choose one of adadelta, adafactor"),
    (["--optimizer", "radam", "--optimizer_kwargs", '{"betaz": [0.9, 0.95]}'],
     "accel_ddp: error: --optimizer_kwargs: RAdam takes no keyword 'betaz'; it takes betas"),
    (["--optimizer", "tests.optim.test_build:not_an_optimizer"],
     "accel_ddp: error: --optimizer tests.optim.test_build:not_an_optimizer returned list, not a "
     "torch.optim.Optimizer"),
])
def test_a_bad_optimizer_is_one_line_and_exit_2_on_every_rank(flags, words, tmp_path, capfd):
    from tests.helpers.runs import main_ranks

    args = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--max_steps", "2",
            "--output_dir", str(tmp_path / "run"), *flags]
    assert main_ranks(args) == [2, 2]
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "error" in line] == [err.strip().splitlines()[-1]], err
    assert err.strip().splitlines()[-1].startswith(words) and "Traceback" not in err, err
