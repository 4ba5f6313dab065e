"""accel_ddp.util.yaml_text: what libyaml writes PyYAML's own code reads to the same values, and the other way round,
so a run's config.yaml reads back wherever it was written, however PyYAML was built there."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from accel_ddp.config.options import TrainConfig
from accel_ddp.util import yaml_text


def _config_yaml_contents() -> dict:
    """What a run writes to config.yaml: every option (None, bools, ints, floats, strings, lists), its resolved facts
    and its start-up block (a multi-line string)."""
    options = {field.name: list(field.default) if isinstance(field.default, tuple) else field.default
               for field in dataclasses.fields(TrainConfig) if field.default is not dataclasses.MISSING}
    options.update(lr=3e-3, weight_decay=1e-8, output_dir="outputs/run é", hf_name=None)
    resolved = {"world_size": 2, "loader": "device", "per_rank_batch_size": 32, "steps_per_epoch": [8, 8],
                "gradient_accumulation_steps": 1, "mixed_precision": "no", "note": "x" * 300}
    startup = "accel_ddp 0.1 | torch 2.14\n  model: mnist_cnn (1.2M parameters)\n  data: synthetic, 256 samples\n"
    return {**options, "resolved": resolved, "startup": startup}


def test_libyaml_is_used_where_pyyaml_has_it():
    expected = "CSafeDumper" if yaml.__with_libyaml__ else "SafeDumper"
    assert yaml_text._DUMPER.__name__ == expected
    assert yaml_text._LOADER.__name__ == expected.replace("Dumper", "Loader")


def test_a_config_yaml_written_by_either_reads_back_the_same_values_with_either():
    contents = _config_yaml_contents()
    for text in (yaml_text.dump(contents), yaml.safe_dump(contents, sort_keys=False)):
        assert yaml_text.load(text) == yaml.safe_load(text) == contents
        assert list(yaml_text.load(text)) == list(contents)  # the options' order is kept


def test_malformed_yaml_raises_pyyamls_error():
    with pytest.raises(yaml.YAMLError):
        yaml_text.load("lr: [0.1\nmodel: x\n")
