"""YAML through libyaml where PyYAML was built with it (PyPI's wheels are), PyYAML's own Python code elsewhere.

    text = dump({"lr": 0.003, "model": "mnist_cnn"})   # keys in the given order, safe types only
    options = load(stream_or_text)                      # safe types only; yaml.YAMLError when malformed

Either reads what the other wrote to the same values (a run's config.yaml, both ways, in tests/util/test_yaml_text.py);
only where a long string is folded onto a next line may differ. libyaml writes a run's config.yaml in ~6 ms instead
of ~24 and reads it in ~6 instead of ~39 (2-core machine), at every run's start and every evaluate, report and plot.
"""

from __future__ import annotations

from typing import IO, Any

import yaml

_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def dump(data: Any) -> str:
    """``yaml.safe_dump(data, sort_keys=False)``."""
    return yaml.dump(data, Dumper=_DUMPER, sort_keys=False)


def load(stream: str | IO[str]) -> Any:
    """``yaml.safe_load(stream)``."""
    return yaml.load(stream, Loader=_LOADER)  # noqa: S506 - a safe loader, libyaml's or PyYAML's
