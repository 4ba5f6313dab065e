"""Bad input to a task (accel_ddp/tasks/protocol.py, evaluation.py, update.py): a user's loss, collate_fn or metric that
returns the wrong thing, labels the model cannot take, evaluations with nothing to count.

Each is one line ``accel_ddp: error: ...`` naming the value and the fix, exit code 2, as early as it can be
known (the start-up probe where it can), or a figure reported as missing (null), never a wrong number.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.data import TensorRows, batches_until_data_error
from tests.helpers.runs import main_ranks

TINY = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--hidden_size", "8",
        "--global_batch_size", "16", "--epochs", "1"]


def error_lines(stderr: str) -> list[str]:
    """The lines of a run's stderr that say something went wrong: accel_ddp's own, and any traceback. An error met
    mid-training may follow the progress bar on its line: the line is taken from ``accel_ddp: error`` on."""
    marker = "accel_ddp: error"
    return [line[line.index(marker):] if marker in line else line for line in stderr.splitlines()
            if marker in line or "Traceback" in line or "Error:" in line]


def one_error(capfd, *parts: str) -> str:
    lines = error_lines(capfd.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("accel_ddp: error: "), lines
    assert all(part in lines[0] for part in parts), lines[0]
    return lines[0]


def nothing_written(out: Path) -> bool:
    return not out.exists() or not any(out.iterdir())


# ----------------------------------------------------------------------------- losses


def count_is_text(outputs, batch):
    return F.cross_entropy(outputs, batch[1], reduction="sum"), "many"


def count_per_sample(outputs, batch):
    return F.cross_entropy(outputs, batch[1], reduction="sum"), torch.ones(len(batch[1]))


def count_is_zero(outputs, batch):
    return F.cross_entropy(outputs, batch[1], reduction="sum"), 0


def count_zero_in_training(outputs, batch):
    """Right at the start-up probe (which runs without grad), a sum over 0 items in every training step."""
    items = torch.zeros((), dtype=torch.long) if torch.is_grad_enabled() else torch.tensor(len(batch[1]))
    return F.cross_entropy(outputs, batch[1], reduction="sum"), items


def detached(outputs, batch):
    return F.cross_entropy(outputs, batch[1]).detach()


def as_number(outputs, batch):
    return torch.tensor(F.cross_entropy(outputs, batch[1]).item())


@pytest.mark.parametrize("loss, message", [
    ("count_is_text", "the loss function tests.tasks.test_errors:count_is_text returned a (sum, num_items) pair whose "
                      "num_items is str 'many', not a count; return the number of items the sum adds up"),
    ("count_per_sample", "the loss function tests.tasks.test_errors:count_per_sample returned a (sum, num_items) "
                         "pair whose num_items is a tensor of shape (2,), not a count"),
    ("count_is_zero", "the loss function tests.tasks.test_errors:count_is_zero returned a (sum, num_items) pair with "
                      "a non-zero sum over num_items 0 (a sum over no items is 0); return the count of the items"),
])
def test_a_loss_whose_count_is_not_a_count_is_refused_at_start_up(tmp_path, capfd, loss, message):
    out = tmp_path / "out"
    assert main_ranks([*TINY, "--loss", f"tests.tasks.test_errors:{loss}", "--output_dir", str(out)]) == [2, 2]
    one_error(capfd, message)
    assert nothing_written(out)


@pytest.mark.parametrize("when", ["log line", "save"])
def test_a_sum_over_zero_items_in_training_stops_at_the_next_sync_before_anything_is_saved(tmp_path, capfd, when):
    """No host sync per step: the flag is counted on the device and read where the loop syncs anyway."""
    out = tmp_path / "out"
    extra = ["--log_every", "1"] if when == "log line" else ["--log_every", "100", "--checkpointing_steps", "2"]
    args = [*TINY, "--loss", "tests.tasks.test_errors:count_zero_in_training", *extra, "--output_dir", str(out)]
    assert main_ranks(args) == [2, 2]
    one_error(capfd, "returned a (sum, num_items) pair with a non-zero sum over num_items 0")
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()


@pytest.mark.parametrize("loss", ["detached", "as_number"])
def test_a_loss_detached_from_the_model_is_one_line_at_the_first_step(tmp_path, capfd, loss):
    out = tmp_path / "out"
    assert main_ranks([*TINY, "--loss", f"tests.tasks.test_errors:{loss}", "--output_dir", str(out)]) == [2, 2]
    one_error(capfd, f"the loss function tests.tasks.test_errors:{loss} returned a loss detached from the model "
                     "(no grad_fn")
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()


def test_max_length_1_for_a_causal_lm_is_refused(tmp_path, capfd):
    """One token per sequence leaves nothing to predict: today's run would report loss 0.0 and perplexity 1.0."""
    from accel_ddp.cli.train import main

    out = tmp_path / "out"
    assert main(["--task", "causal_lm", "--max_length", "1", "--dataset", "hf", "--output_dir", str(out)]) == 2
    one_error(capfd, "--max_length 1 with --task causal_lm leaves no next token to predict", "--max_length 2 or more")
    assert nothing_written(out)


# ----------------------------------------------------------------------------- a collate_fn that makes no batch


def returns_none(samples):
    return None


def returns_the_samples(samples):
    return list(samples)


@pytest.mark.parametrize("collate, what", [
    ("returns_none", "returned None, not a batch"),
    ("returns_the_samples", "returned a list of 2 without a tensor (tuple), not a batch"),
])
def test_a_collate_fn_that_returns_no_batch_is_named_at_start_up(tmp_path, capfd, collate, what):
    out = tmp_path / "out"
    args = [*TINY, "--loader", "dataloader", "--collate_fn", f"tests.tasks.test_errors:{collate}",
            "--output_dir", str(out)]
    assert main_ranks(args) == [2, 2]
    one_error(capfd, f"the collate_fn tests.tasks.test_errors:{collate} {what}; return a tuple (inputs, labels, ...)")
    assert nothing_written(out)


# ----------------------------------------------------------------------------- eval_loss is the user's loss

VOCAB, LENGTH = 11, 6


class TokenModel(torch.nn.Module):
    """A user's own token-level model: (B, T) token ids in, (B, T, VOCAB) logits out."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))


def token_sum(outputs, batch):
    """The user's loss: cross-entropy summed over the tokens whose label is not -100, and their count."""
    labels = batch[1]
    loss = F.cross_entropy(outputs.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    return loss, (labels != -100).sum()


def token_mean(outputs, batch):
    return F.cross_entropy(outputs.flatten(0, 1), batch[1].flatten(), ignore_index=-100)


def token_sets(count: int, seed: int) -> torch.utils.data.TensorDataset:
    """Token sequences whose labels are the tokens shifted by one; a varying number of them ignored (-100)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)
    labels = (tokens + 1) % VOCAB
    cut = torch.randint(1, LENGTH + 1, (count, 1), generator=generator)
    labels[torch.arange(LENGTH) >= cut] = -100
    return torch.utils.data.TensorDataset(tokens, labels)


def _evaluate_tokens(loss_fn, world: int, count: int = 37, batch_size: int = 4) -> list[dict]:
    from accel_ddp import TrainConfig
    from accel_ddp.assemble import build_world
    from accel_ddp.data.loaders import build_eval_loader
    from accel_ddp.evaluation import evaluate
    from accel_ddp.tasks.protocol import build_task
    from tests.helpers.multiproc import run_ranks

    def fn():
        accelerator, _, _ = build_world(TrainConfig(global_batch_size=2))
        torch.manual_seed(0)
        model = accelerator.prepare(TokenModel())
        loader = accelerator.prepare(build_eval_loader(token_sets(count, seed=1), batch_size, 0))
        return evaluate(accelerator, model, loader, build_task("classification", loss_fn=loss_fn))

    return run_ranks(fn, world_size=world)


@pytest.mark.parametrize("loss_fn", [token_sum, token_mean])
def test_eval_loss_is_the_user_loss_item_weighted_each_sample_once_at_any_world_size(loss_fn, capfd):
    """37 sequences in batches of 4 on 2 ranks: the DataLoader repeats samples 0-2 in the last batch; the user's
    batch-level loss is computed without them. A (sum, items) loss is token-weighted; a mean counts per sample."""
    one, (rank0, rank1) = _evaluate_tokens(loss_fn, 1)[0], _evaluate_tokens(loss_fn, 2)
    torch.manual_seed(0)
    model = TokenModel().eval()
    tokens, labels = token_sets(37, seed=1).tensors
    with torch.no_grad():
        if loss_fn is token_sum:  # every token once
            expected = token_sum(model(tokens), (tokens, labels))
            expected = (expected[0] / expected[1]).item()
        else:  # each batch's mean counted once per sample of it
            batches = [(tokens[i:i + 4], labels[i:i + 4]) for i in range(0, 37, 4)]
            expected = sum(token_mean(model(x), (x, y)).item() * len(x) for x, y in batches) / 37
    for result in (one, rank0, rank1):
        assert result["eval_samples"] == 37
        assert result["eval_loss"] == pytest.approx(expected, rel=1e-6), result
        assert "eval_accuracy" not in result  # (B, T, V) logits are not (batch, classes)
    assert rank0 == rank1
    notes = [line for line in capfd.readouterr().err.splitlines() if "accel_ddp: note:" in line]
    assert notes and all(note == notes[0] for note in notes)  # one per evaluating process (here: 3)
    assert "eval_accuracy left out of the evaluation; eval_loss is tests.tasks.test_errors:" in notes[0]


def test_a_token_level_model_with_its_own_loss_trains_and_reports_that_loss_without_a_traceback(tmp_path, capfd):
    """The default task's cross-entropy does not fit (B, T, V) logits: once a traceback at start-up; now eval_loss
    is the user's token-weighted loss, eval_accuracy is left out (null) with one note."""
    from accel_ddp import TrainConfig, train
    from tests.helpers.multiproc import run_ranks
    from tests.helpers.runs import read_metrics, read_summary

    def fn():
        torch.manual_seed(0)
        config = TrainConfig(global_batch_size=8, epochs=2, lr=0.05, output_dir=str(tmp_path))
        return train(config, model=TokenModel(), train_dataset=token_sets(64, 0), eval_dataset=token_sets(21, 1),
                     loss_fn=token_sum)

    rank0, rank1 = run_ranks(fn)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "accel_ddp: error" not in err
    notes = [line for line in err.splitlines() if "accel_ddp: note:" in line]
    assert notes == ["accel_ddp: note: the model's logits of shape (2, 6, 11) do not fit labels of shape (2, 6) "
                     "(classification takes (batch, classes) logits and (batch,) class ids): eval_accuracy left out "
                     "of the evaluation; eval_loss is tests.tasks.test_errors:token_sum"]
    evals = [record for record in read_metrics(tmp_path) if "eval_loss" in record]
    assert len(evals) == 2 and all("eval_accuracy" not in record for record in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # the user's loss, evaluated, went down
    summary = read_summary(tmp_path)
    assert summary["eval_accuracy"] is None and summary["eval_samples"] == 21
    assert summary["eval_loss"] == rank0["eval_loss"] == rank1["eval_loss"] == evals[-1]["eval_loss"]


def smoothed(outputs, batch):
    return F.cross_entropy(outputs, batch[1], label_smoothing=0.3)


def test_a_user_loss_on_class_logits_is_eval_loss_and_the_task_still_reports_accuracy():
    from accel_ddp import TrainConfig
    from accel_ddp.assemble import build_world
    from accel_ddp.data.loaders import build_eval_loader
    from accel_ddp.evaluation import evaluate
    from accel_ddp.tasks.protocol import build_task
    from tests.helpers.multiproc import run_ranks

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 5, generator=generator)
    y = (x[:, 0] > 0).long()

    def fn():
        accelerator, _, _ = build_world(TrainConfig(global_batch_size=2))
        torch.manual_seed(0)
        model = accelerator.prepare(torch.nn.Linear(5, 3))
        loader = accelerator.prepare(build_eval_loader(torch.utils.data.TensorDataset(x, y), 4, 0))
        return [evaluate(accelerator, model, loader, build_task("classification", loss_fn=fn))
                for fn in (None, smoothed)]

    (default, user), _ = run_ranks(fn)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    with torch.no_grad():
        logits = model(x)
        expected = sum(smoothed(logits[i:i + 4], (x, y[i:i + 4])).item() * len(y[i:i + 4]) for i in range(0, 37, 4))
    assert user["eval_loss"] == pytest.approx(expected / 37, rel=1e-6)
    assert default["eval_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)
    assert user["eval_loss"] != pytest.approx(default["eval_loss"], rel=1e-3)
    assert user["eval_accuracy"] == default["eval_accuracy"] == (logits.argmax(1) == y).double().mean().item()


# ----------------------------------------------------------------------------- evaluations with nothing to count


def test_eval_texts_without_a_token_to_predict_report_null_not_zero(tmp_path, capfd):
    """One-token eval texts: nothing to predict. Not loss 0.0 and perplexity 1.0: null, and the line says so."""
    pytest.importorskip("transformers")
    from accel_ddp import TrainConfig, train
    from tests.helpers.multiproc import run_ranks
    from tests.helpers.runs import read_metrics, read_summary
    from tests.helpers.text import Sequences, tiny_gpt

    def fn():
        torch.manual_seed(0)
        config = TrainConfig(task="causal_lm", global_batch_size=8, max_steps=4, output_dir=str(tmp_path))
        return train(config, model=tiny_gpt(), train_dataset=Sequences(32), eval_dataset=Sequences(9, 1, 1, 1))

    summary = run_ranks(fn)[0]
    for figures in (summary, read_summary(tmp_path), read_metrics(tmp_path)[-1]):
        assert figures["eval_samples"] == 9 and figures["eval_tokens"] == 0
        assert figures["eval_loss"] is figures["eval_perplexity"] is figures["eval_accuracy"] is None, figures
    assert "step 4 epoch 0: no eval items (9 samples)" in capfd.readouterr().out


def empty_eval(data_dir, download):
    from accel_ddp.data import DatasetBundle

    x = torch.randn(32, 4)
    return DatasetBundle(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()),
                         torch.utils.data.TensorDataset(x[:0], torch.zeros(0, dtype=torch.long)), 2, (4,))


def test_an_empty_eval_set_is_refused_at_start_up(tmp_path, capfd):
    out = tmp_path / "out"
    args = ["--dataset", "tests.tasks.test_errors:empty_eval", "--global_batch_size", "8", "--output_dir", str(out)]
    assert main_ranks(args) == [2, 2]
    one_error(capfd, "the eval set (TensorDataset) holds no samples, so there is nothing to evaluate; give it "
                     "samples, or train without one")
    assert nothing_written(out)


# ----------------------------------------------------------------------------- user metrics


class Counts:
    """A metric whose compute() returns ``value``; ``lock`` makes it one that cannot be deep-copied."""

    def __init__(self, value, lock: bool = False):
        import threading

        self.value, self.seen = value, 0
        self.lock = threading.Lock() if lock else None

    def update(self, outputs, batch):
        self.seen += len(batch[1])

    def compute(self):
        return {"seen": torch.tensor(self.seen), "extra": self.value}  # a one-element tensor is a number


@pytest.mark.parametrize("metric, message", [
    (Counts([1, 2]), "metric Counts: compute() returned 'extra' as a list of 2, not a number; return one number"),
    (Counts(torch.ones(3)), "metric Counts: compute() returned 'extra' as a tensor of shape (3,), not a number"),
    (Counts("high"), "metric Counts: compute() returned 'extra' as str 'high', not a number"),
    (Counts(1.0, lock=True), "metric Counts cannot be copied (copy.deepcopy raised TypeError: cannot pickle "
                             "'_thread.lock' object); each evaluation starts from a fresh copy of it"),
])
def test_a_metric_that_returns_no_numbers_or_cannot_be_copied_is_named_at_start_up(tmp_path, metric, message):
    from accel_ddp import TrainConfig, train
    from accel_ddp.util.validation import ConfigError
    from tests.helpers.multiproc import run_ranks

    def fn():
        x = torch.randn(32, 4)
        data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
        try:
            train(TrainConfig(global_batch_size=8, output_dir=str(tmp_path / "out")), train_dataset=data,
                  eval_dataset=data, metrics=[metric])
        except ConfigError as err:
            return str(err)

    rank0, rank1 = run_ranks(fn)
    assert rank0 == rank1 and rank0.startswith(message), rank0
    assert nothing_written(tmp_path / "out")


def test_a_metric_of_one_element_tensors_and_none_is_reported_as_numbers_and_null(tmp_path):
    from accel_ddp import TrainConfig, train
    from tests.helpers.multiproc import run_ranks
    from tests.helpers.runs import read_summary

    def fn():
        x = torch.randn(32, 4)
        data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
        return train(TrainConfig(global_batch_size=8, epochs=1, output_dir=str(tmp_path)), train_dataset=data,
                     eval_dataset=data, metrics=[Counts(None)])

    summary = run_ranks(fn, world_size=1)[0]
    assert summary["eval_seen"] == 32 and type(summary["eval_seen"]) is int and summary["eval_extra"] is None
    assert read_summary(tmp_path)["eval_extra"] is None


# ----------------------------------------------------------------------------- labels the model cannot take


def _classes(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 4, generator=generator)
    return x, torch.randint(0, 10, (count,), generator=generator)


def bad_train_label(data_dir, download):
    """10 classes, but training sample 37 is labelled 12."""
    from accel_ddp.data import DatasetBundle

    (x, y), (ex, ey) = _classes(64, 0), _classes(16, 1)
    y[37] = 12
    return DatasetBundle(torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(ex, ey), 10, (4,))


def bad_eval_label(data_dir, download):
    """10 classes, but eval sample 5 is labelled -3."""
    from accel_ddp.data import DatasetBundle

    (x, y), (ex, ey) = _classes(64, 0), _classes(16, 1)
    ey[5] = -3
    return DatasetBundle(torch.utils.data.TensorDataset(x, y), torch.utils.data.TensorDataset(ex, ey), 10, (4,))


@pytest.mark.parametrize("dataset, loader, message", [
    ("bad_train_label", "auto", "training sample 37 has label 12, outside the model's 10 classes (0 to 9); fix the "
                                "label or give the model 13 outputs or more"),
    ("bad_train_label", "dataloader", "training sample 37 has label 12, outside the model's 10 classes"),
    ("bad_eval_label", "auto", "eval sample 5 has label -3, outside the model's 10 classes (0 to 9); fix the label "
                               "(-100 is ignored)"),
])
def test_an_in_memory_label_the_model_cannot_take_is_named_at_start_up_on_every_rank(tmp_path, capfd, dataset,
                                                                                       loader, message):
    """Once an IndexError on one rank and a gloo traceback on the other (on CUDA a device-side assert)."""
    out = tmp_path / "out"
    args = ["--dataset", f"tests.tasks.test_errors:{dataset}", "--hidden_size", "8", "--global_batch_size", "8",
            "--loader", loader, "--output_dir", str(out)]
    assert main_ranks(args) == [2, 2]
    one_error(capfd, message)
    assert nothing_written(out)


BAD_POSITION = 3 * 8 + 5  # step 4 (0-based 3) of epoch 0 with 2 ranks x 4: micro-step 3 of rank (29 // 4) % 2 = 1


def bad_row_label(data_dir, download):
    from accel_ddp.data import DatasetBundle
    from accel_ddp.data.sampler import epoch_order

    (x, y), (ex, ey) = _classes(64, 0), _classes(16, 1)
    y[int(epoch_order(64, 64, seed=0, epoch=0)[BAD_POSITION])] = 10
    return DatasetBundle(TensorRows(x, y), TensorRows(ex, ey), 10, (4,))


def test_a_label_out_of_range_on_the_dataloader_path_is_named_by_the_rank_that_reads_it(tmp_path, capfd):
    """Checked on the host before the copy to the device: no device sync; that rank exits 2 with one line."""
    from accel_ddp.cli.train import main
    from accel_ddp.data.sampler import epoch_order
    from tests.helpers.multiproc import run_ranks

    out = tmp_path / "out"
    args = ["--dataset", "tests.tasks.test_errors:bad_row_label", "--hidden_size", "8", "--global_batch_size", "8",
            "--num_workers", "0", "--checkpointing_steps", "2", "--output_dir", str(out)]

    def run() -> int:
        code = main(args)
        (tmp_path / f"exit{os.environ.get('RANK')}").write_text(str(code))
        return code

    # Rank 1 reports; rank 0, waiting for it in a collective, learns of it and exits quietly with its code.
    assert run_ranks(run, grace=20) == [2, 2]
    index = int(epoch_order(64, 64, seed=0, epoch=0)[BAD_POSITION])
    lines = [line for line in error_lines(capfd.readouterr().err) if line.startswith("accel_ddp: error")]
    assert lines == [f"accel_ddp: error: training sample {index} (epoch 0, optimizer step 4, rank 1) has label 10, "
                     "outside the model's 10 classes (0 to 9); fix the label or give the model 11 outputs or more"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]  # step 4 was never saved


def bad_eval_row(data_dir, download):
    from accel_ddp.data import DatasetBundle

    (x, y), (ex, ey) = _classes(64, 0), _classes(16, 1)
    ey[11] = 30
    return DatasetBundle(TensorRows(x, y), TensorRows(ex, ey), 10, (4,))


def test_an_eval_label_out_of_range_on_the_eval_dataloader_is_named_before_the_copy(tmp_path, capfd):
    from accel_ddp.cli.train import main

    out = tmp_path / "out"
    args = ["--dataset", "tests.tasks.test_errors:bad_eval_row", "--hidden_size", "8", "--global_batch_size", "8",
            "--eval_batch_size", "4", "--num_workers", "0", "--output_dir", str(out)]
    assert main(args) == 2
    one_error(capfd, "eval sample 11 has label 30, outside the model's 10 classes (0 to 9)")
    assert not (out / "model.safetensors").exists() and not (out / "summary.json").exists()


def regression(outputs, batch):
    """A user's loss on integer targets beyond the model's outputs: what the labels mean is its business."""
    return F.mse_loss(outputs[:, 0], batch[1].float())


def test_with_a_users_loss_labels_beyond_the_outputs_leave_the_task_figures_out_with_a_note(tmp_path, capfd):
    from accel_ddp import TrainConfig, train
    from tests.helpers.multiproc import run_ranks

    def fn():
        (x, y), (ex, ey) = _classes(64, 0), _classes(16, 1)
        y, ey = y % 2, ey % 2
        y[3], ey[4] = 15, 20
        config = TrainConfig(model="mlp", hidden_size=8, global_batch_size=8, epochs=1, output_dir=str(tmp_path))
        return train(config, model=torch.nn.Linear(4, 2), train_dataset=torch.utils.data.TensorDataset(x, y),
                     eval_dataset=torch.utils.data.TensorDataset(ex, ey), loss_fn=regression)

    summary = run_ranks(fn)[0]
    assert summary["eval_accuracy"] is None and summary["eval_loss"] > 0 and summary["eval_samples"] == 16
    err = capfd.readouterr().err
    assert "Traceback" not in err and "accel_ddp: error" not in err
    assert [line for line in err.splitlines() if "accel_ddp: note" in line] == [
        "accel_ddp: note: eval sample 4 has label 20, outside the model's 2 classes (0 to 1); fix the label or give "
        "the model 21 outputs or more: eval_accuracy left out of the evaluation; eval_loss is "
        "tests.tasks.test_errors:regression"]


def token_sets_beyond(data_dir, download):
    """causal_lm samples with token ids up to 47; sample 21 holds 47."""
    pytest.importorskip("transformers")
    from accel_ddp.data import DatasetBundle
    from tests.helpers.text import Sequences

    train, evals = Sequences(40), Sequences(8, seed=1)
    for rows in (train.rows, evals.rows):
        for row in rows:
            row.clamp_(max=30)
    train.rows[21][1] = 47
    return DatasetBundle(train, evals, 2, (16,))


def small_vocabulary_gpt(num_classes, input_shape):
    from tests.helpers.text import tiny_gpt

    return tiny_gpt(vocab=40)


def test_token_ids_beyond_the_models_vocabulary_are_named_before_the_embedding_fails(tmp_path, capfd):
    from accel_ddp.cli.train import main

    out = tmp_path / "out"
    args = ["--task", "causal_lm", "--dataset", "tests.tasks.test_errors:token_sets_beyond", "--model",
            "tests.tasks.test_errors:small_vocabulary_gpt", "--global_batch_size", "40", "--num_workers", "0",
            "--output_dir", str(out)]
    assert main(args) == 2
    one_error(capfd, "training sample 21 (epoch 0, optimizer step 1, rank 0) has token id 47 in 'input_ids', "
                     "outside the model's vocabulary of 40 (its embedding size); tokenize with the model's own "
                     "tokenizer (--tokenizer), or resize its embeddings")


def _decode_with_a_bad_label(columns, where):
    return [(torch.tensor([float(i)]), 12 if i == 24 else i % 10) for i in columns["idx"]]


def test_a_label_out_of_range_while_streaming_stops_every_rank_at_the_same_step_with_one_line(tmp_path):
    """Rank 1's third micro-batch holds example 24, labelled 12 for a model of 10 classes: checked on the host before
    the copy, reported like bad data (every rank stops before that step, with rank 1's line)."""
    from tests.helpers.data import write_shards
    from tests.helpers.multiproc import run_ranks

    files = write_shards(tmp_path / "s", [20, 20, 20, 20])  # rank 1 reads files 1 and 3: examples 20.. first

    def run():
        import datasets
        from accelerate import PartialState

        from accel_ddp.data.streaming import StreamingLoader, StreamSource
        from accel_ddp.tasks.labels import IdRange, batch_check

        state = PartialState(cpu=True)
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        loader = StreamingLoader(StreamSource(stream, _decode_with_a_bad_label, 0), 2, 4, max_steps=10, seed=0,
                                 rank=state.process_index, world_size=2, num_workers=0)
        loader.batch_check = batch_check([IdRange(1, 10, "classes")])
        return batches_until_data_error(loader)

    (steps0, line0), (steps1, line1) = run_ranks(run, grace=5)
    assert (steps0, steps1) == (2, 2)
    assert line0 == line1 == ("streaming: example 0 of a micro-batch of rank 1 at optimizer step 3 of pass 0 has "
                              "label 12, outside the model's 10 classes (0 to 9); fix the label or give the model 13 "
                              "outputs or more")


class TextLabels(torch.utils.data.Dataset):
    """Dict samples for a Transformers classifier: 8 token ids and a class label; ``bad`` maps index -> label."""

    def __init__(self, count: int, bad: dict[int, int]):
        self.count, self.bad = count, bad

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        return {"input_ids": torch.arange(8) % 20 + index % 3, "labels": torch.tensor(self.bad.get(index, index % 2))}


def text_with_a_bad_label(data_dir, download):
    from accel_ddp.data import DatasetBundle

    return DatasetBundle(TextLabels(32, {0: 3}), TextLabels(8, {}), 2, (8,))


def tiny_classifier(num_classes, input_shape):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16, num_labels=2, pad_token_id=0)
    return GPT2ForSequenceClassification(config)


def test_a_label_beyond_a_transformers_classifiers_num_labels_is_named_before_its_forward(tmp_path, capfd):
    """The model computes its own loss from `labels`: the start-up forward would be an IndexError traceback."""
    pytest.importorskip("transformers")
    out = tmp_path / "out"
    args = ["--task", "sequence_classification", "--dataset", "tests.tasks.test_errors:text_with_a_bad_label",
            "--model", "tests.tasks.test_errors:tiny_classifier", "--global_batch_size", "8", "--output_dir", str(out)]
    assert main_ranks(args) == [2, 2]
    one_error(capfd, "training sample 0 has label 3, outside the model's 2 classes (0 to 1); fix the label or give "
                     "the model 4 outputs or more")
    assert nothing_written(out)


def summed_cross_entropy(outputs, batch):
    return F.cross_entropy(outputs, batch[1], reduction="sum"), torch.tensor(len(batch[1]))


def test_the_check_for_a_sum_over_no_items_adds_no_host_sync_per_step(tmp_path):
    """The flag is counted on the device with the running sums: 16 more steps add no .item()-like call."""
    from tests.helpers.multiproc import run_ranks
    from tests.helpers.syncs import OVERHEAD_RUN as OVERHEAD
    from tests.helpers.syncs import count_host_syncs

    def counts(steps: int, name: str):
        args = [*OVERHEAD, "--loss", "tests.tasks.test_errors:summed_cross_entropy", "--max_steps", str(steps),
                "--log_every", "1000", "--eval_every", "1000", "--output_dir", str(tmp_path / name)]
        return run_ranks(lambda: count_host_syncs(args), world_size=2)

    short, long = counts(8, "short"), counts(24, "long")
    assert short == long, (short, long)
