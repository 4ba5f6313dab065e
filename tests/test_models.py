"""Built-in models (resnet18 for small images) and the user-model contract."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accel_ddp.models import MODELS, ResNet18, build_model
from accel_ddp.util.validation import ConfigError


def wide_linear(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """A user model, importable as tests.test_models:wide_linear."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))


def not_a_model(num_classes: int, input_shape: tuple[int, ...]):
    return "a string"


@pytest.mark.parametrize("input_shape,num_classes", [((3, 32, 32), 10), ((1, 28, 28), 7), ((1, 8, 8), 3),
                                                     ((5, 12, 9), 100)])
def test_resnet18_takes_any_channels_small_sizes_and_class_counts(input_shape, num_classes):
    model = build_model("resnet18", num_classes, input_shape, width=8)
    assert model(torch.randn(2, *input_shape)).shape == (2, num_classes)
    assert model.conv1.in_channels == input_shape[0]
    assert model.conv1.stride == (1, 1) and model.conv1.kernel_size == (3, 3)  # small-image stem, no max-pool


def test_resnet18_width_64_has_torchvisions_layers_and_names():
    from torchvision.models import resnet18

    ours = build_model("resnet18", 10, (3, 32, 32)).state_dict()
    theirs = resnet18(num_classes=10).state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if ours[k].shape != theirs[k].shape] == ["conv1.weight"]  # 3x3 stem instead of 7x7


def test_resnet18_width_scales_every_stage():
    def params(width):
        return sum(p.numel() for p in ResNet18(10, (3, 32, 32), width).parameters())

    model = ResNet18(10, (3, 32, 32), width=16)
    assert [model.layer1[0].conv1.out_channels, model.layer4[1].conv2.out_channels, model.fc.in_features] == \
        [16, 128, 128]
    assert 3.5 < params(32) / params(16) < 4.1  # parameters grow with the square of the width


def test_resnet18_learns_a_fixed_batch():
    torch.manual_seed(0)
    model = build_model("resnet18", 4, (3, 16, 16), width=8)
    inputs, labels = torch.randn(16, 3, 16, 16), torch.arange(16) % 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = F.cross_entropy(model(inputs), labels)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.25 * first


@pytest.mark.parametrize("input_shape,expected", [((784,), "needs image inputs"), ((3, 4, 4), "at least 8x8")])
def test_resnet18_rejects_inputs_it_cannot_take(input_shape, expected):
    with pytest.raises(ConfigError, match=expected):
        build_model("resnet18", 10, input_shape)


def test_registered_models_and_hidden_size_still_apply():
    assert set(MODELS) >= {"mlp", "mnist_cnn", "resnet18"}
    assert build_model("mlp", 10, (1, 8, 8), hidden_size=32)[1].out_features == 32


def test_user_model_through_an_import_string():
    model = build_model("tests.test_models:wide_linear", 5, (2, 3))
    assert model(torch.randn(4, 2, 3)).shape == (4, 5)


@pytest.mark.parametrize("name,expected", [
    ("tests.test_models:not_a_model", "must return a torch.nn.Module"),
    ("tests.test_models:missing", "has no function 'missing'"),
    ("no_such_pkg.models:build", "cannot import module"),
    ("resnet17", "unknown model"),
])
def test_bad_model_names_are_one_clear_error(name, expected):
    with pytest.raises(ConfigError, match=expected):
        build_model(name, 10, (1, 8, 8))
