"""A user's collate_fn on every data path: in memory (through a DataLoader), memory-mapped; refused with
--loader device."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from accel_ddp import TrainConfig, train
from tests.helpers.data import hf_image_dataset
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import load_weights, main_ranks, train_ranks_in_turn

# ----------------------------------------------------------------------------- a user's collate_fn on every path


def doubling_collate(samples):
    """A user's collate_fn: inputs doubled; one line per call (the batch size) in a file per rank."""
    with open(f"{os.environ['COLLATE_LOG']}.{os.environ.get('RANK', '0')}", "a") as log:
        log.write(f"{len(samples)}\n")
    inputs, labels = torch.utils.data.default_collate(samples)
    return inputs * 2, labels


def _collate_run(out: Path, loader: str, collate_fn=None, scale: float = 1.0) -> dict:
    generator = torch.Generator().manual_seed(0)
    x, eval_x = torch.randn(64, 6, generator=generator), torch.randn(37, 6, generator=generator)
    y, eval_y = (x[:, 0] > 0).long(), (eval_x[:, 0] > 0).long()
    config = TrainConfig(model="mlp", hidden_size=8, global_batch_size=16, epochs=2, loader=loader,
                         optimizer="sgd", lr=0.1, output_dir=str(out))
    return train(config, train_dataset=TensorDataset(x * scale, y), eval_dataset=TensorDataset(eval_x * scale, eval_y),
                 collate_fn=collate_fn)


def test_a_collate_fn_on_an_in_memory_set_makes_every_training_and_eval_batch(tmp_path, capfd, monkeypatch):
    """--loader auto would take the device loader, which never calls a collate_fn: the run goes through a
    DataLoader instead (one note), and trains and evaluates exactly like the same data doubled beforehand."""
    monkeypatch.setenv("COLLATE_LOG", str(tmp_path / "calls"))
    collated, reference, (plain, _) = zip(*run_ranks(lambda: [  # in turn in the same forked ranks
        _collate_run(tmp_path / "collated", "auto", doubling_collate),
        _collate_run(tmp_path / "doubled", "dataloader", scale=2.0),
        _collate_run(tmp_path / "plain", "auto")]), strict=True)
    assert collated[0]["loader"] == "dataloader" and plain["loader"] == "device"
    notes = [line for line in capfd.readouterr().err.splitlines() if "accel_ddp: note:" in line]
    assert notes == ["accel_ddp: note: the collate_fn tests.data.test_collate:doubling_collate makes the batches, so "
                     "this in-memory training set goes through a DataLoader (--loader dataloader), not the device "
                     "loader"]
    got, expected = load_weights(tmp_path / "collated"), load_weights(tmp_path / "doubled")
    assert all(torch.equal(got[key], expected[key]) for key in expected)
    assert not all(torch.equal(got[key], load_weights(tmp_path / "plain")[key]) for key in expected)
    for key in ("eval_loss", "eval_accuracy", "eval_samples"):
        assert collated[0][key] == collated[1][key] == reference[0][key], key
    assert collated[0]["eval_loss"] != plain["eval_loss"]
    # Per rank: the start-up probe's 2 samples, 2 epochs x 4 steps of 8, then 2 eval batches of 16 per epoch.
    for rank in (0, 1):
        assert (tmp_path / f"calls.{rank}").read_text().split() == ["2"] + (["8"] * 4 + ["16"] * 2) * 2


def test_a_collate_fn_with_loader_device_is_one_line_and_exit_2(tmp_path, capfd):
    out = tmp_path / "out"
    args = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--global_batch_size",
            "16", "--loader", "device", "--collate_fn", "tests.data.test_collate:doubling_collate",
            "--output_dir", str(out)]
    assert main_ranks(args) == [2, 2]
    lines = [line for line in capfd.readouterr().err.splitlines() if "accel_ddp:" in line or "Traceback" in line]
    assert lines == ["accel_ddp: error: --loader device batches the in-memory tensors on the device and never calls "
                     "the collate_fn tests.data.test_collate:doubling_collate; use --loader auto or --loader "
                     "dataloader with it, or drop it"]
    assert not out.exists()


def test_a_collate_fn_makes_the_memory_mapped_paths_training_and_eval_batches(tmp_path, monkeypatch):
    folder = tmp_path / "d"
    folder.mkdir()
    hf_image_dataset(48, 0, size=8).to_parquet(str(folder / "train.parquet"))
    hf_image_dataset(20, 1, size=8).to_parquet(str(folder / "test.parquet"))
    common = ["--dataset", "hf", "--data_dir", str(folder), "--device_loader_max_mb", "0", "--num_workers", "1",
              "--global_batch_size", "16", "--epochs", "1"]
    monkeypatch.setenv("COLLATE_LOG", str(tmp_path / "calls"))
    [collated], [plain] = train_ranks_in_turn([  # in turn in the same forked process
        [*common, "--collate_fn", "tests.data.test_collate:doubling_collate", "--output_dir",
         str(tmp_path / "collated")],
        [*common, "--output_dir", str(tmp_path / "plain")]], world_size=1)
    assert collated["data_source"] == "memory_mapped" and collated["loader"] == "dataloader"
    assert (tmp_path / "calls.0").read_text().split() == ["2", "16", "16", "16", "20"]  # probe, 3 steps, 1 eval batch
    assert collated["eval_loss"] != plain["eval_loss"]
