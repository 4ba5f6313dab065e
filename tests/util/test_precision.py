"""accel_ddp.util.precision: the one map from Accelerate's mixed_precision to the dtype autocast computes in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from accelerate.utils import PrecisionType

import accel_ddp
from accel_ddp.config import MIXED_PRECISIONS
from accel_ddp.util.precision import autocast_dtype

PACKAGE = Path(accel_ddp.__file__).parent


@pytest.mark.parametrize(("precision", "dtype"), [
    ("bf16", torch.bfloat16), ("fp16", torch.float16), (PrecisionType.BF16, torch.bfloat16),
    ("no", None), ("fp8", None), (None, None),  # fp8: its own recipe, not autocast's; None: the model's dtype
])
def test_each_mixed_precision_computes_in_its_dtype(precision, dtype):
    assert autocast_dtype(precision) is dtype


def test_every_precision_the_options_accept_is_mapped_and_nothing_else():
    assert {p for p in MIXED_PRECISIONS if autocast_dtype(p) is not None} == {"bf16", "fp16"}


def precision_maps(package: Path) -> list[str]:
    """``path:line`` of each dict literal outside util/precision.py that maps a precision name to a torch dtype."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).as_posix() == "util/precision.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in MIXED_PRECISIONS
                                                  for k in node.keys) \
                    and any(isinstance(v, ast.Attribute) and v.attr in ("bfloat16", "float16") for v in node.values):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    return found


def test_no_other_module_maps_a_precision_to_a_dtype(tmp_path):
    assert precision_maps(PACKAGE) == []
    (tmp_path / "planted.py").write_text('import torch\nDTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}\n')
    assert precision_maps(tmp_path) == ["planted.py:2"]
