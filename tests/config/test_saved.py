"""config/saved.py: a trained run's config.yaml options read back as its TrainConfig, and made ready to evaluate."""

from __future__ import annotations

from pathlib import Path

import pytest

from accel_ddp.config import TrainConfig
from accel_ddp.config.saved import evaluation_config, saved_config
from accel_ddp.util.validation import ConfigError

TINY_GPT2 = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_gpt2.json"


def _written(**options) -> dict:
    """What a run's config.yaml holds besides its resolved facts and start-up block: every option."""
    return TrainConfig(**options).to_dict()


def test_the_options_read_back_as_the_config_they_were():
    assert saved_config(_written(lr=0.5, max_steps=12), "run/config.yaml") == TrainConfig(lr=0.5, max_steps=12)


@pytest.mark.parametrize(("change", "message"), [
    ({"no_such_option": 1}, "run/config.yaml: option(s) no_such_option unknown to this accel_ddp; evaluate it with "
                            "the version that trained it"),
    ({"lr": -1.0}, "run/config.yaml: --lr must be > 0, got -1.0"),
])
def test_an_option_this_version_does_not_take_is_one_line_naming_the_file(change, message):
    with pytest.raises(ConfigError) as caught:
        saved_config({**_written(), **change}, "run/config.yaml")
    assert str(caught.value).startswith(message)


def test_evaluation_compiles_nothing_and_resumes_nothing():
    options = _written(compile=True, resume_from_checkpoint="auto", init_from="base.safetensors", global_batch_size=64)
    cfg = evaluation_config(options, "run/config.yaml", world_size=2, checkpoint=False)
    assert (cfg.compile, cfg.resume_from_checkpoint, cfg.init_from) == (False, None, None)
    regions = evaluation_config(_written(compile_regions=True), "run/config.yaml", world_size=2, checkpoint=False)
    assert regions.compile_regions is False
    assert (cfg.global_batch_size, cfg.lr) == (64, TrainConfig().lr)  # the rest as trained


def test_a_fine_tuned_runs_checkpoint_keeps_its_base():
    """A --peft run's checkpoint holds the adapter only: the base comes from --init_from again; its final weights are
    whole, and a checkpoint of a run without --peft is whole too."""
    options = _written(peft="lora", init_from="base.safetensors", task="causal_lm",
                       model_config=str(TINY_GPT2))
    assert evaluation_config(options, "c", 1, checkpoint=True).init_from == "base.safetensors"
    assert evaluation_config(options, "c", 1, checkpoint=False).init_from is None
    plain = _written(init_from="base.safetensors")
    assert evaluation_config(plain, "c", 1, checkpoint=True).init_from is None


def test_a_world_that_does_not_divide_the_global_batch_evaluates_with_its_share():
    cfg = evaluation_config(_written(global_batch_size=64), "c", world_size=3, checkpoint=False)
    assert (cfg.global_batch_size, cfg.per_device_batch_size, cfg.eval_batch_size) == (63, 21, 42)
    assert evaluation_config(_written(global_batch_size=64), "c", 4, False).global_batch_size == 64
