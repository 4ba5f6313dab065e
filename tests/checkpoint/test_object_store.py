"""Output and checkpoint locations given as URLs: ``file://`` is a local folder, any other scheme is refused
(one line, exit 2) until it is supported, never a local folder named after it."""

from __future__ import annotations

import os

import pytest

from tests.helpers.ranks import error_lines
from tests.helpers.runs import main_ranks, read_summary

ARGS = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "1", "4", "4",
        "--model", "mlp", "--hidden_size", "8", "--global_batch_size", "16", "--epochs", "1", "--num_workers", "0"]


@pytest.mark.parametrize("flag, url", [
    ("--output_dir", "s3://bucket/run"),
    ("--output_dir", "gs://bucket/run"),
    ("--output_dir", "az://container/run"),
    ("--resume_from_checkpoint", "s3://bucket/run/checkpoints/step_00000004"),
    ("--init_from", "hf://org/model/model.safetensors"),
])
def test_a_url_is_one_line_exit_2_and_no_local_folder_named_after_it(flag, url, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # where Accelerate's save_state would have made "s3:/bucket/run"
    extra = [] if flag == "--output_dir" else ["--output_dir", str(tmp_path / "run")]
    assert main_ranks([*ARGS, *extra, flag, url]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and f"{flag} {url}" in lines[0] and "not supported yet" in lines[0], err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_a_file_url_is_the_local_folder(tmp_path):
    out = tmp_path / "run"
    assert main_ranks([*ARGS, "--output_dir", f"file://{out}"]) == [0, 0]
    assert read_summary(out)["optimizer_steps"] == 4
