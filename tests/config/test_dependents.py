"""accel_ddp/config/dependents.py: every flag that only means something with another option is refused, in one line,
where nothing in the run would use it, and accepted where something does; row by row of the one table."""

from __future__ import annotations

import dataclasses
import re

import pytest

from accel_ddp.config import TrainConfig
from accel_ddp.config.dependents import DEPENDENTS
from accel_ddp.util.validation import ConfigError

# flag: (a value other than its default, options under which the run uses it, options under which it does not)
CASES = {
    "shuffle_buffer": (5, dict(streaming=True, dataset="hf", max_steps=10), {}),
    "hf_name": ("org/set", dict(dataset="hf"), {}),
    "hf_config": ("plain", dict(dataset="hf"), {}),
    "hf_train_split": ("other", dict(dataset="hf"), {}),
    "hf_eval_split": ("validation", dict(dataset="hf"), {}),
    "image_column": ("img", dict(dataset="hf"), {}),
    "label_column": ("y", dict(dataset="hf"), {}),
    "image_size": (32, dict(dataset="imagefolder"), dict(dataset="synthetic")),
    "text_column": ("body", dict(task="causal_lm"), {}),
    "tokenizer": ("tok", dict(task="sequence_classification"), {}),
    "max_length": (64, dict(task="causal_lm"), {}),
    "synthetic_samples": (64, dict(dataset="synthetic"), {}),
    "synthetic_shape": ((4,), dict(dataset="synthetic"), dict(dataset="mnist")),
    "synthetic_classes": (3, dict(dataset="synthetic"), dict(dataset="pkg.data:build")),
    "download": (True, dict(dataset="mnist"), dict(dataset="synthetic")),
    "device_loader_max_mb": (0, dict(loader="dataloader", dataset="hf"), dict(loader="dataloader")),
    "hidden_size": (16, {}, dict(model="resnet18")),
    "width": (16, dict(model="resnet18"), {}),
    "packing": (True, dict(task="causal_lm"), dict(task="sequence_classification")),
    "text_cache": ("/tmp/blocks", dict(task="causal_lm", packing=True, dataset="hf"), {}),
    "lora_r": (4, dict(peft="lora"), {}),
    "lora_alpha": (8.0, dict(peft="lora"), {}),
    "lora_dropout": (0.1, dict(peft="lora"), {}),
    "lora_target_modules": ("c_attn", dict(peft="lora"), {}),
    "merge_adapter": (True, dict(peft="lora"), {}),
    "spike_window": (5, dict(spike_factor=3.0), {}),
    "max_anomalies": (3, dict(on_anomaly="skip"), {}),
    "store_timeout": (5.0, dict(checkpoint_dir="file:///tmp/store"), {}),
    "greater_is_better": (True, dict(metric_for_best_model="accuracy"), {}),
    "early_stopping_threshold": (0.1, dict(early_stopping_patience=2), {}),
    "tracker_project_name": ("p", dict(with_tracking=True), {}),
    "run_name": ("r", dict(with_tracking=True), {}),
    "tracker_start_timeout": (5.0, dict(with_tracking=True), {}),
}
ROWS = {row.flag: row for row in DEPENDENTS}


def test_every_row_names_an_option_once_and_every_row_has_its_case():
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert len(ROWS) == len(DEPENDENTS), "a flag in two rows"
    assert set(ROWS) <= set(fields), set(ROWS) - set(fields)
    assert set(CASES) == set(ROWS)
    for flag, (value, _, _) in CASES.items():
        assert value != fields[flag], f"{flag}: the sample is its default"


@pytest.mark.parametrize("flag", list(CASES))
def test_a_dependent_flag_is_accepted_where_it_is_used_and_refused_in_one_line_where_not(flag):
    value, used, unused = CASES[flag]
    assert getattr(TrainConfig(**used, **{flag: value}), flag) == value
    with pytest.raises(ConfigError) as err:
        TrainConfig(**unused, **{flag: value})
    message = str(err.value)
    assert message.startswith(f"--{flag} ") and ": nothing would use it; " in message, message
    assert message.endswith(", or drop it") and "\n" not in message
    unmet = next(needs for needs in ROWS[flag].needs if not needs.used(TrainConfig(**unused)))
    assert unmet.fix in message


@pytest.mark.parametrize("options, expected", [
    (dict(text_cache="/tmp/blocks", task="causal_lm"),
     "--text_cache without --packing: nothing would use it; add --packing, or drop it"),
    (dict(text_cache="/tmp/blocks"),
     "--text_cache on --task classification: nothing would use it; add --task causal_lm --packing, or drop it"),
    (dict(text_cache="off", task="causal_lm", packing=True, dataset="digits"),
     "--text_cache with --dataset digits: nothing would use it; add --dataset hf"),
    (dict(text_cache="/tmp/blocks", task="causal_lm", packing=True, dataset="hf", hf_name="org/set"),
     "--text_cache with --hf_name (a Hub dataset is not cached): nothing would use it; save it with save_to_disk"),
    (dict(store_timeout=5.0), "--store_timeout without an object store --checkpoint_dir: nothing would use it; add "
                              "--checkpoint_dir s3://bucket/run (or gs://, az://), or drop it"),
    (dict(lora_dropout=0.1, merge_adapter=True, shuffle_buffer=5),  # the first row's condition, its flags together
     "--shuffle_buffer without --streaming: nothing would use it"),
    (dict(lora_dropout=0.1, merge_adapter=True),
     "--lora_dropout, --merge_adapter without --peft: nothing would use them; add --peft lora, or drop them"),
    # the model sizes: a user's builder gets num_classes and input_shape only; a config.json sizes its own model
    (dict(hidden_size=16, model="my_pkg.models:build"), "--hidden_size with --model my_pkg.models:build: nothing "
     "would use it; add --model mlp (a pkg.module:function model is called with num_classes and input_shape only)"),
    (dict(hidden_size=16, model="tests.helpers.faults:nan_mlp"), "--hidden_size with --model tests.helpers.faults:"),
    (dict(hidden_size=16, width=8, model_config="config.json"), "--hidden_size, --width with --model_config (its "
     "config.json sizes the model): nothing would use them; set the size in that config.json, or drop them"),
    (dict(width=8), "--width with --model mlp: nothing would use it; add --model resnet18"),
    (dict(synthetic_samples=64, synthetic_shape=(4,), dataset="hf"), "--synthetic_samples, --synthetic_shape with "
     "--dataset hf: nothing would use them; add --dataset synthetic, or drop them"),
    (dict(download=True, dataset="imagefolder"), "--download with --dataset imagefolder, which downloads nothing: "
     "nothing would use it; give --dataset mnist, fashion_mnist, cifar10 or hf, or drop it"),
    (dict(device_loader_max_mb=0, loader="dataloader"), "--device_loader_max_mb with --loader dataloader: nothing "
     "would use it; use --loader auto (or --dataset hf, whose decoded size it bounds), or drop it"),
])
def test_the_issues_cases_in_their_words(options, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig(**options)


def test_the_sizes_are_used_where_the_model_or_dataset_reads_them():
    """models.py build_model sizes mlp and resnet18, also named as its own builders; data/builtin.py hands the
    download flag to a user's dataset builder, and hf's main process loads first with it."""
    assert TrainConfig(model="accel_ddp.models:build_mlp", hidden_size=16).hidden_size == 16
    assert TrainConfig(model="accel_ddp.models:build_resnet18", width=16).width == 16
    assert TrainConfig(dataset="my_pkg.data:build", download=True).download is True
    assert TrainConfig(dataset="hf", download=True).download is True
    assert TrainConfig(loader="device", device_loader_max_mb=0).device_loader_max_mb == 0


def test_a_size_too_large_for_memory_is_still_refused_where_the_run_builds_it():
    """The memory check (options.py ``_check_sizes``) comes after the table: a size nothing builds is refused as
    unused, one the run builds as too large."""
    with pytest.raises(ConfigError, match="--width 4096 is too large"):
        TrainConfig(model="resnet18", width=4096)
    with pytest.raises(ConfigError, match="--width with --model mlp: nothing would use it"):
        TrainConfig(width=4096)
    with pytest.raises(ConfigError, match="--hidden_size 100000000 is too large"):
        TrainConfig(hidden_size=100_000_000)


def test_on_the_command_line_it_is_one_line_and_exit_2(tmp_path, capfd):
    from accel_ddp.cli.train import main

    capfd.readouterr()
    assert main(["--dataset", "synthetic", "--max_steps", "1", "--store_timeout", "5",
                 "--output_dir", str(tmp_path / "run")]) == 2
    err = capfd.readouterr().err
    assert err.count("accel_ddp: error: --store_timeout without an object store --checkpoint_dir: nothing would use "
                     "it") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()
