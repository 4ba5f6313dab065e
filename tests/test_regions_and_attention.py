"""--compile_regions (the repeated blocks compiled in place) and --attn_implementation (Transformers' attention)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from accel_ddp import TrainConfig  # noqa: E402
from accel_ddp.models import build_transformers_model, set_attn_implementation  # noqa: E402
from accel_ddp.tasks.protocol import build_task  # noqa: E402
from accel_ddp.transforms.regional_compile import compile_regions  # noqa: E402
from accel_ddp.util.validation import ConfigError  # noqa: E402
from tests.helpers.multiproc import run_ranks  # noqa: E402
from tests.helpers.runs import main_ranks  # noqa: E402
from tests.helpers.text import tiny_gpt  # noqa: E402


@pytest.fixture
def gpt2_json(tmp_path):
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64,
                                "vocab_size": 48}))
    return str(path)


@pytest.mark.parametrize("name", ["eager", "sdpa"])
def test_attn_implementation_reaches_the_transformers_model(gpt2_json, name):
    model = build_transformers_model("causal_lm", config_file=gpt2_json, attn_implementation=name)
    assert model.config._attn_implementation == name
    model.save_pretrained(gpt2_json + ".folder")
    loaded = build_transformers_model("causal_lm", folder=gpt2_json + ".folder", attn_implementation=name)
    assert loaded.config._attn_implementation == name
    given = tiny_gpt()
    set_attn_implementation(given, name)  # a model the caller built
    assert given.config._attn_implementation == name


def test_attn_implementation_the_model_or_machine_cannot_run_is_refused_with_one_line(gpt2_json, tmp_path, capfd):
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash_attn is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match=r"^--attn_implementation flash_attention_2: --model_config .* cannot use "
                                          r"it \(.*\); choose sdpa or eager") as err:
        build_transformers_model("causal_lm", config_file=gpt2_json, attn_implementation="flash_attention_2")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="not a Transformers model"):
        set_attn_implementation(torch.nn.Linear(2, 2), "sdpa")
    with pytest.raises(ConfigError, match="--attn_implementation 'flash' is unknown; choose one of eager, sdpa"):
        TrainConfig(attn_implementation="flash")
    out = tmp_path / "o"  # the built-in mlp on the digits: not a Transformers model
    assert main_ranks(["--attn_implementation", "sdpa", "--max_steps", "1", "--output_dir", str(out)],
                      world_size=1) == [2]
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("accel_ddp: error:")]
    assert len(lines) == 1 and "--attn_implementation sdpa" in lines[0] and "--model mlp is not one" in lines[0]


@pytest.mark.slow
def test_regional_compilation_gives_the_eager_loss_and_gradients_and_keeps_the_parameter_names():
    """A 2-layer GPT-2 on the CPU (inductor): its 2 blocks compiled in place, the same loss within 1e-5 and the same
    gradients within 1e-4 relative as the eager model with the same weights; state_dict names unchanged. In a forked
    process: a compiled backward leaves autograd threads in the process, after which no test could fork ranks."""
    run_ranks(_compile_and_compare, world_size=1)


def _compile_and_compare() -> None:
    torch.manual_seed(0)
    eager = tiny_gpt()
    compiled = tiny_gpt()
    compiled.load_state_dict(eager.state_dict())
    names = list(compiled.state_dict())
    assert compile_regions(compiled) == 2
    assert list(compiled.state_dict()) == names and compiled.transformer.h[0]._compiled_call_impl is not None
    batch = {"input_ids": torch.randint(2, 48, (4, 16), generator=torch.Generator().manual_seed(1))}
    task = build_task("causal_lm")
    want, got = task.training_loss(eager, batch), task.training_loss(compiled, batch)
    assert (got.value - want.value).abs() / want.value.abs() < 1e-5
    want.value.backward()
    got.value.backward()
    compiled_params = dict(compiled.named_parameters())
    for name, param in eager.named_parameters():
        grad = compiled_params[name].grad
        assert ((grad - param.grad).norm() / param.grad.norm()).item() < 1e-4, name


def test_regional_compilation_refuses_a_model_without_repeated_blocks_and_the_whole_model_compile():
    with pytest.raises(ConfigError, match="--compile_regions: Sequential has no repeated blocks"):
        compile_regions(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    with pytest.raises(ConfigError, match="--compile_regions and --compile.*give one"):
        TrainConfig(compile_regions=True, compile=True)
