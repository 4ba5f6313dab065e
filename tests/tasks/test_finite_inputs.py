"""A nan in the data or in --init_from's weights is named before training (exit 2), not met at the first step as
a nan loss (exit 3, "lower --lr"); a nan in a host batch (the DataLoader path, memory-mapped sets, streaming) is
named by the worker that collates it, before the step that would train on it."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from safetensors.torch import save_file
from torch.utils.data import TensorDataset

from tests.helpers.data import TensorRows, mapped_floats_with_inf, read_at, write_shards
from tests.helpers.multiproc import run_ranks
from tests.helpers.ranks import error_lines
from tests.helpers.runs import main_ranks

BAD_ROW = 37


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return x, (x[:, 0] > 0).long()


def nan_train_row(data_dir, download):
    from accel_ddp.data import DatasetBundle

    (x, y), (ex, ey) = _data(64, 0), _data(16, 1)
    x[BAD_ROW, 3] = float("nan")
    return DatasetBundle(TensorDataset(x, y), TensorDataset(ex, ey), 2, (6,))


def inf_eval_row(data_dir, download):
    from accel_ddp.data import DatasetBundle

    (x, y), (ex, ey) = _data(64, 0), _data(16, 1)
    ex[5, 0] = float("inf")
    return DatasetBundle(TensorDataset(x, y), TensorDataset(ex, ey), 2, (6,))


ARGS = ["--hidden_size", "8", "--global_batch_size", "16", "--max_steps", "4", "--num_workers", "0"]


@pytest.mark.parametrize("dataset, named", [("nan_train_row", f"training sample {BAD_ROW}"),
                                            ("inf_eval_row", "eval sample 5")])
def test_a_nan_input_is_named_before_training_not_blamed_on_the_lr(dataset, named, tmp_path, capfd):
    out = tmp_path / "run"
    assert main_ranks(["--dataset", f"tests.tasks.test_finite_inputs:{dataset}", *ARGS,
                       "--output_dir", str(out)]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert lines == [f"accel_ddp: error: {named} holds nan or inf input values; a nan or inf input makes the loss "
                     "nan whatever --lr; clean the data or leave that sample out"], err
    assert "lower --lr" not in err and "Traceback" not in err


def test_the_probe_batch_names_its_field():
    from accel_ddp.tasks.finite import batch_problem

    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "pixel_values": torch.zeros(2, 4)}
    assert batch_problem(batch, lambda row: f"sample {row}") is None
    batch["pixel_values"][1, 2] = float("nan")
    assert batch_problem(batch, lambda row: f"sample {row}") == (
        "sample 1 holds nan or inf values (its 'pixel_values'); a nan or inf input makes the loss nan whatever --lr; "
        "clean the data or leave that sample out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_the_one_reduction_check_finds_each_kind_of_non_finite_value_in_each_float_type(dtype, value):
    from accel_ddp.data.non_finite import first_non_finite_row

    tensor = torch.randn(6, 2, 3).to(dtype)
    assert first_non_finite_row(tensor) is None
    tensor[4, 1, 2] = value
    assert first_non_finite_row(tensor) == 4
    assert first_non_finite_row(torch.zeros(6, 0)) is None and first_non_finite_row(torch.ones(6, 3).long()) is None


def test_nan_in_init_from_weights_names_the_file_and_the_tensor(tmp_path, capfd):
    """The weights of a run that diverged, given to --init_from: one line naming the file and the tensor, exit 2."""
    out, weights = tmp_path / "run", tmp_path / "diverged.safetensors"
    args = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "1", "4", "4", "--model", "mlp",
            "--hidden_size", "8", "--global_batch_size", "16", "--max_steps", "2", "--num_workers", "0"]
    assert main_ranks([*args, "--output_dir", str(out)]) == [0, 0]
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    name = sorted(state)[0]
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(weights))
    capfd.readouterr()
    assert main_ranks([*args, "--output_dir", str(tmp_path / "tuned"), "--init_from", str(weights)]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"accel_ddp: error: --init_from {weights}: its tensor {name} holds nan or inf values "
                               f"(1 of {state[name].numel()}); these weights are damaged"), lines
    assert "lower --lr" not in err


# ----------------------------------------------------------------------------- host batches, checked in the worker

NAN_FIX = "a nan or inf input makes the loss nan whatever --lr; clean the data or leave that sample out"
HOST_BAD = read_at(3, 1, 64, 16, 2)  # the sample rank 1 of 2 reads first at optimizer step 3 (global batch 16)


def nan_host_row(data_dir, download):
    from accel_ddp.data import DatasetBundle

    (x, y), (ex, ey) = _data(64, 0), _data(16, 1)
    x[HOST_BAD, 2] = float("nan")
    return DatasetBundle(TensorRows(x, y), TensorRows(ex, ey), 2, (6,))


@pytest.mark.parametrize("workers", ["1", "0"])
def test_a_nan_in_a_dataloader_batch_names_the_sample_and_its_step_on_every_rank(tmp_path, capfd, workers):
    """--loader dataloader with one worker (or none: the rank collates): the worker that collates the batch finds
    the nan; rank 1, which reads it, prints one line naming the sample, its epoch and step and the field; both ranks
    exit 2, nothing says "lower --lr"."""
    out = tmp_path / "run"
    assert main_ranks(["--dataset", "tests.tasks.test_finite_inputs:nan_host_row", "--loader", "dataloader",
                       "--hidden_size", "8", "--global_batch_size", "16", "--max_steps", "4", "--num_workers", workers,
                       "--output_dir", str(out)]) == [2, 2]
    err = capfd.readouterr().err
    assert error_lines(err) == [f"accel_ddp: error: training sample {HOST_BAD} (epoch 0, optimizer step 3, rank 1) "
                                f"holds nan or inf values (its input); {NAN_FIX}"], err
    assert "lower --lr" not in err and "Traceback" not in err


def test_a_nan_in_a_memory_mapped_set_is_named_by_the_worker(tmp_path):
    """A datasets.Dataset read memory-mapped through a DataLoader worker: its dict batch's float field is checked,
    its integer labels are not."""
    from accel_ddp.data import DataError, HostLoader

    loader = HostLoader(mapped_floats_with_inf(tmp_path / "d"), 4, 8, seed=0, num_workers=1)
    step, row = next((s, r) for s, rows in enumerate(loader.sampler.rank_indices(0).tolist()) for r, i in
                     enumerate(rows) if i == 13)
    read = 0
    with pytest.raises(DataError) as caught:
        for _ in loader:
            read += 1
    assert read == step
    assert multiprocessing.active_children() == []  # the pass ended by the error: its worker stopped and joined
    assert str(caught.value) == (f"training sample 13 (epoch 0, optimizer step {step // 2 + 1}, rank 0) holds nan "
                                 f"or inf values (its 'x'); {NAN_FIX}")


def _decode_floats(columns, where):
    return [(torch.tensor([float("nan") if i == 27 else float(i)]), 0) for i in columns["idx"]]


@pytest.mark.parametrize("workers", [1, 0])
def test_a_nan_in_a_streamed_batch_stops_every_rank_at_its_step_with_one_line(tmp_path, workers):
    """Streaming with a worker (or none): rank 1 reads example 27 (files 1 and 3 are its), its worker finds the nan;
    every rank stops at that step with the same line naming the example, the reader and the pass."""
    files = write_shards(tmp_path / "s", [20, 20, 20, 20])

    def run():
        import datasets
        from accelerate import PartialState

        from accel_ddp.data.streaming import StreamingLoader, StreamSource

        state = PartialState(cpu=True)
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        loader = StreamingLoader(StreamSource(stream, _decode_floats, 0), 2, 4, max_steps=10, seed=0,
                                 rank=state.process_index, world_size=2, num_workers=workers)
        trained = 0
        try:
            for _ in loader:
                trained += 1
        except Exception as err:  # noqa: BLE001 - what each rank raised goes back to the test
            return trained, type(err).__name__, str(err)
        return trained, None, None

    (steps0, kind0, text0), (steps1, kind1, text1) = run_ranks(run, grace=5)
    assert (steps0, steps1) == (3, 3)  # examples 20..25 trained on; 26, 27 make step 4
    assert kind0 == kind1 == "DataError" and text0 == text1
    assert text1 == (f"streaming: example 7 read by worker 0 of rank 1 in pass 0 holds nan or inf values (its input); "
                     f"{NAN_FIX}")
