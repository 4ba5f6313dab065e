"""accel_ddp/evaluation.py: evaluation on every rank, each eval sample counted exactly once at any world size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from accel_ddp.evaluation import first_samples, real_samples
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import read_summary, train_ranks


def test_eval_counts_each_sample_once_with_an_odd_eval_set(tmp_path):
    """Both eval paths: an in-memory shard per rank (device loader) and a padded DataLoader (gather_for_metrics)."""
    summaries = {}
    for loader in ("device", "dataloader"):
        train_ranks(["--dataset", "tests.helpers.data:odd_eval", "--model", "tests.helpers.data:tiny_linear",
                     "--global_batch_size", "16", "--eval_batch_size", "4", "--epochs", "2", "--loader", loader,
                     "--output_dir", str(tmp_path / loader)])
        summaries[loader] = read_summary(tmp_path / loader)
        assert summaries[loader]["world_size"] == 2 and summaries[loader]["loader"] == loader
        assert summaries[loader]["eval_samples"] == 37  # 2 ranks x 4-sample batches would pad the DataLoader to 40
    # Both loaders train the same weights, so the two evaluations must agree on every sample.
    device, dataloader = summaries["device"], summaries["dataloader"]
    assert device["eval_accuracy"] == dataloader["eval_accuracy"]
    assert abs(device["eval_loss"] - dataloader["eval_loss"]) < 1e-6


def _evaluate_a_fixed_model(batch_size: int) -> tuple[dict, dict]:
    """evaluate() of one fixed linear model over 37 samples through a prepared DataLoader on this rank, and the
    figures of the whole set computed in one piece."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from accel_ddp.evaluation import evaluate

    accelerator = Accelerator(cpu=True)
    x = torch.randn(37, 6, generator=torch.Generator().manual_seed(3))
    y = (x[:, 1] > 0).long()
    torch.manual_seed(0)  # the same weights on every rank
    model = torch.nn.Linear(6, 2)
    loader = accelerator.prepare(DataLoader(TensorDataset(x, y), batch_size=batch_size))
    with torch.no_grad():
        logits = model(x)
    whole = {"eval_samples": 37, "correct": int((logits.argmax(1) == y).sum()),
             "eval_loss": float(torch.nn.functional.cross_entropy(logits.double(), y))}
    return evaluate(accelerator, model, loader), whole


@pytest.mark.parametrize("world", [1, 2])
def test_a_prepared_dataloaders_repeats_are_not_counted(world):
    """37 samples in batches of 4 on 2 ranks: the DataLoader pads the last global batch to 40; the figures are the
    whole set's, once each, the same on every rank."""
    outcomes = run_ranks(lambda: _evaluate_a_fixed_model(4), world_size=world)
    results = [result for result, _ in outcomes]
    whole = outcomes[0][1]
    assert all(result == results[0] for result in results)
    assert results[0]["eval_samples"] == 37
    assert results[0]["eval_accuracy"] == pytest.approx(whole["correct"] / 37, abs=1e-12)
    assert results[0]["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)


def test_real_samples_are_the_rows_gather_for_metrics_keeps():
    """The last batch of 37 samples in batches of 4 on 2 ranks: 5 real rows of the 8 served (rank 0: 4, rank 1: 1);
    a full batch: all real; a rank past the end: none."""
    def on(rank: int) -> SimpleNamespace:
        return SimpleNamespace(process_index=rank)

    assert [real_samples(on(rank), gathered=5, size=4) for rank in (0, 1)] == [4, 1]
    assert [real_samples(on(rank), gathered=8, size=4) for rank in (0, 1)] == [4, 4]
    assert [real_samples(on(rank), gathered=3, size=4) for rank in (0, 1, 2)] == [3, 0, 0]


def test_first_samples_cuts_per_sample_tensors_only():
    outputs = {"logits": torch.arange(8.0).reshape(4, 2), "loss": torch.tensor(1.5)}
    batch = {"labels": torch.arange(4), "name": "kept"}
    cut_outputs, cut_batch = first_samples((outputs, batch), batch_size=4, count=3)
    assert torch.equal(cut_outputs["logits"], outputs["logits"][:3]) and torch.equal(cut_batch["labels"],
                                                                                      torch.arange(3))
    assert cut_outputs["loss"] is outputs["loss"] and cut_batch["name"] == "kept"
    tree = (outputs, batch)
    assert first_samples(tree, batch_size=4, count=4) is tree  # a full batch: nothing to cut
