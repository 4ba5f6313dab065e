"""The streaming path (accel_ddp/data/streaming.py): uneven shares, resume from each rank's position, seeds,
failures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from accel_ddp import train
from accel_ddp.cli.args import parse_args
from accel_ddp.data import (
    HostLoader,
)
from accel_ddp.data.loaders import data_source
from accel_ddp.util.validation import ConfigError
from tests.helpers import faults
from tests.helpers.checkpoints import load_stream_position, save_stream_position
from tests.helpers.data import image_shards, write_shards
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.runs import load_weights, main_ranks, read_metrics, train_ranks, train_ranks_in_turn

# ----------------------------------------------------------------------------- streaming


def _decode_idx(columns, where):
    return [(torch.tensor([float(i)]), 0) for i in columns["idx"]]


def _read(files: list[str], world: int, *, max_steps: int, workers: int = 1, buffer: int = 0, per_device: int = 2,
          stop_after: int | None = None, save_to: Path | None = None, save_after: int | None = None,
          resume_from: Path | None = None) -> list[tuple[int, list[int]]]:
    """In a forked rank: its (pass, example ids) per micro-batch from a StreamingLoader (accumulation 1); the
    position saved to ``save_to`` after ``stop_after`` micro-batches (the last read), or after ``save_after``
    (reading on, as a run that checkpoints does)."""
    import datasets
    from accelerate import PartialState

    from accel_ddp.data.streaming import StreamingLoader, StreamSource

    state = PartialState(cpu=True)
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    loader = StreamingLoader(StreamSource(stream, _decode_idx, buffer), per_device, per_device * world,
                             max_steps=max_steps, seed=0, rank=state.process_index, world_size=world,
                             num_workers=workers)
    batches = loader
    if resume_from is not None:
        load_stream_position(loader, resume_from)
        batches = loader.skip_first_batches(int(resume_from.name))
    seen = []
    for x, _ in batches:
        seen.append((loader.data_epoch, x[:, 0].long().tolist()))
        if len(seen) == save_after:
            save_stream_position(loader, save_to)
        if len(seen) == stop_after:
            save_stream_position(loader, save_to)
            break
    return seen


def _stream(files: list[str], world: int, **read) -> list[list[tuple[int, list[int]]]]:
    """Each rank's ``_read(files, world, **read)`` from ``world`` forked ranks."""
    return run_ranks(lambda: _read(files, world, **read), world_size=world)


def _passes(ranks: list[list[tuple[int, list[int]]]]) -> dict[int, list[int]]:
    """Example ids per pass, over all ranks."""
    out: dict[int, list[int]] = {}
    for rank in ranks:
        for data_epoch, ids in rank:
            out.setdefault(data_epoch, []).extend(ids)
    return out


@pytest.mark.parametrize("sizes,buffer,steps", [([7, 11, 20], 0, 12), ([5, 30, 5, 6], 0, 12), ([5, 30, 5, 6], 8, 10)])
def test_streaming_ranks_take_the_same_steps_over_uneven_shares(tmp_path, sizes, buffer, steps):
    """3 files over 2 ranks (every rank reads all, keeps every 2nd example) or 4 files of very different sizes:
    every rank yields a batch at every step, each example at most once per pass; the shortest share ends the pass.
    With a shuffle buffer, 10 steps: two whole passes of 5 (each pass's end waits out datasets' thread shutdown)."""
    files = write_shards(tmp_path / "s", sizes)
    ranks = _stream(files, 2, max_steps=steps, buffer=buffer, workers=0)  # read in each rank's process: no forks
    assert [len(rank) for rank in ranks] == [steps, steps]
    assert [[e for e, _ in rank] for rank in ranks][0] == [[e for e, _ in rank] for rank in ranks][1]  # in step
    passes = _passes(ranks)
    assert len(passes) >= 2
    for ids in passes.values():
        assert len(ids) == len(set(ids)) and set(ids) <= set(range(sum(sizes)))
    if buffer:  # a new shuffle each pass (without a buffer only the file order may change)
        assert passes[0] != passes[1][:len(passes[0])]
    if sizes == [5, 30, 5, 6] and buffer == 0:  # rank 0 reads files 0 and 2 (10 rows): the pass ends after 5 steps
        rank0 = sorted(i for data_epoch, ids in ranks[0] if data_epoch == 0 for i in ids)
        assert len(passes[0]) == 5 * 4 and rank0 == [*range(5), *range(35, 40)]


def test_streaming_resumes_from_each_ranks_saved_position(tmp_path):
    """Saved after 7 steps (by a run that reads on to its end, as a run that checkpoints does) and resumed: nothing
    trained before comes again in that pass; without a shuffle buffer the resumed stream is the uninterrupted one
    (with 2 workers the 8th batch is the second worker's: the DataLoader's turns continue where they stopped).
    Three readers (1 worker, 2 workers, 2 workers and a shuffle buffer) read in turn in the same forked ranks; the
    resumes in a second pair, which never read the saving streams."""
    files = write_shards(tmp_path / "s", [40, 40, 40, 40])
    cases = [(1, 0), (2, 0), (2, 16)]  # (workers, shuffle buffer)
    saved = {case: tmp_path / f"{case[0]}-{case[1]}" / "7" for case in cases}
    for folder in saved.values():
        folder.mkdir(parents=True)
    wholes = run_ranks(lambda: [_read(files, 2, max_steps=12, workers=workers, buffer=buffer, save_after=7,
                                      save_to=saved[workers, buffer]) for workers, buffer in cases])
    rests = run_ranks(lambda: [_read(files, 2, max_steps=12, workers=workers, buffer=buffer,
                                     resume_from=saved[workers, buffer]) for workers, buffer in cases])
    for k, (workers, buffer) in enumerate(cases):
        whole, rest = [rank[k] for rank in wholes], [rank[k] for rank in rests]
        assert [len(rank) for rank in whole] == [12, 12], (workers, buffer)
        first = [rank[:7] for rank in whole]
        assert sorted(p.name for p in saved[workers, buffer].iterdir()) == ["data_state_rank0.json",
                                                                           "data_state_rank1.json"]
        assert [len(rank) for rank in rest] == [5, 5], (workers, buffer)
        if buffer == 0:
            assert [a + b for a, b in zip(first, rest, strict=True)] == whole, (workers, buffer)
        before, after = _passes(first)[0], _passes(rest)[0]
        assert not set(before) & set(after) and len(set(after)) == len(after), (workers, buffer)


def _batch_and_worker_seed(samples):  # a collate_fn that tells which seed the process collating it has
    return torch.utils.data.default_collate(samples), torch.initial_seed()


@pytest.mark.parametrize("workers", [0, 1])
def test_the_streaming_loader_leaves_the_global_generator_alone(tmp_path, workers):
    """The DataLoader of each pass draws its workers' base seed from a generator seeded by (seed, pass), not from
    torch's global one: dropout after a resume continues where the checkpoint's RNG state left it."""
    import datasets

    from accel_ddp.data.streaming import StreamingLoader, StreamSource

    files = write_shards(tmp_path / "s", [6])  # 3 steps of 2 per pass

    def worker_seeds(global_seed: int) -> list[tuple[int, int]]:
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        loader = StreamingLoader(StreamSource(stream, _decode_idx, 0), 2, 2, max_steps=7, seed=5,
                                 num_workers=workers, collate_fn=_batch_and_worker_seed)
        torch.manual_seed(global_seed)
        expected = torch.rand(1)
        torch.manual_seed(global_seed)
        seen = [(loader.data_epoch, seed) for _, seed in loader]
        assert len(seen) == 7 and torch.equal(torch.rand(1), expected)
        return seen

    seeds = worker_seeds(0)
    if workers:  # the workers' seeds: one per pass, whatever the global generator holds
        assert seeds == worker_seeds(1) and len({seed for _, seed in seeds}) == 3


def test_a_streaming_checkpoint_counts_the_step_it_was_saved_after(tmp_path):
    """Saved after a pass's only step: the position holds that step, so the resumed run starts the next pass
    instead of calling the pass too short for one optimizer step."""
    files = write_shards(tmp_path / "s", [3])  # one step of 2 per pass (the odd example is dropped)
    saved = tmp_path / "1"
    saved.mkdir()
    _stream(files, 1, max_steps=4, workers=0, stop_after=1, save_to=saved)
    assert json.loads((saved / "data_state_rank0.json").read_text())["steps_in_pass"] == 1
    [rest] = _stream(files, 1, max_steps=4, workers=0, resume_from=saved)
    assert rest == [(1, [0, 1]), (2, [0, 1]), (3, [0, 1])]


def test_streaming_cli_run_on_uneven_files_resumes_and_counts_eval_exactly(tmp_path,
                                                                          quick_orphan_workers):
    """3 files of different sizes over 2 ranks: no hang, the same steps on both; a failed run resumes from its
    checkpoint's stream positions (mid-pass: the first pass ends after step 14) and crosses the pass's end;
    the eval split (odd-sized) is counted exactly."""
    data = image_shards(tmp_path / "d", [40, 70, 10], n_test=13)
    common = ["--dataset", "hf", "--data_dir", str(data), "--streaming", "--max_steps", "20", "--global_batch_size",
              "8", "--shuffle_buffer", "16", "--num_workers", "1", "--checkpointing_steps", "5", "--eval_every", "10"]

    def fail_at_step_12_on_rank_0():
        faults.install(fail_at=(12, 0))
        return train(parse_args([*common, "--output_dir", str(tmp_path / "run")]))

    with pytest.raises(RankFailed, match="injected failure on rank 0 at step 12"):
        run_ranks(fail_at_step_12_on_rank_0, grace=5)
    saved = tmp_path / "run" / "checkpoints" / "step_00000010"
    assert {"data_state_rank0.json", "data_state_rank1.json"} <= {p.name for p in saved.iterdir()}
    summaries = train_ranks([*common, "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", "auto"])
    for summary in summaries:
        assert (summary["loader"], summary["data_source"]) == ("streaming", "streaming")
        assert summary["optimizer_steps"] == 20 and summary["resumed_from_step"] == 10
        assert summary["eval_samples"] == 13
    evals = [r for r in read_metrics(tmp_path / "run") if "eval_samples" in r]
    assert [r["step"] for r in evals] == [10, 20]


_MORE_STEPS = ["--streaming", "--global_batch_size", "8", "--shuffle_buffer", "0", "--num_workers", "0",
               "--lr_schedule", "constant", "--hidden_size", "16"]


def test_a_streaming_run_given_more_steps_continues_where_it_stopped(tmp_path):
    """A finished streaming run relaunched with a higher --max_steps continues from its checkpoint (a stream's
    "epoch" is the whole run, so its steps_per_epoch grows with --max_steps; not a reason to refuse). Without a
    shuffle buffer and with the ranks reading in their own process, it ends with the weights of a run given the
    whole length at once (docs/large-datasets.md: the resumed order is the uninterrupted one). An asynchronous save
    holds the stream's positions too: they are part of the run's TrainState. Two files, one per rank (10 steps per
    pass); the whole run and the two stopped ones (saved as usual, or asynchronously) train in turn in the same
    forked ranks, the two relaunches in a second pair: a resume never reads what its own process trained."""
    common = ["--dataset", "hf", "--data_dir", str(image_shards(tmp_path / "d", [40, 40], n_test=4)), *_MORE_STEPS]
    saves = {"sync": [], "async": ["--async_checkpointing"]}
    train_ranks_in_turn([[*common, "--max_steps", "14", "--output_dir", str(tmp_path / "whole")]] +
                        [[*common, "--max_steps", "7", "--checkpointing_steps", "7", *more, "--output_dir",
                          str(tmp_path / name)] for name, more in saves.items()])
    for name in saves:
        saved = {p.name for p in (tmp_path / name / "checkpoints" / "step_00000007").iterdir()}
        assert {"data_state_rank0.json", "data_state_rank1.json"} <= saved, name
    resumed = train_ranks_in_turn([[*common, "--max_steps", "14", "--output_dir", str(tmp_path / name),
                                    "--resume_from_checkpoint", "auto"] for name in saves])
    theirs = load_weights(tmp_path / "whole")
    for name, summaries in zip(saves, resumed, strict=True):
        assert [(s["resumed_from_step"], s["optimizer_steps"]) for s in summaries] == [(7, 14), (7, 14)], name
        ours = load_weights(tmp_path / name)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), name


def test_a_stream_that_fails_on_one_rank_stops_every_rank_with_one_line(tmp_path, capfd, monkeypatch):
    """Rank 1's second file is cut short: both ranks stop at the same step, exit 2, one line names the file."""
    import accel_ddp.data.hf_stream

    # The start-up rows (STATS_SAMPLE, 1024) would read every file of a small set, the damaged one too, and name it
    # before training; 64 of them come from files 0-1 (the forked ranks inherit it), so rank 1 meets it mid-stream.
    monkeypatch.setattr(accel_ddp.data.hf_stream, "STATS_SAMPLE", 64)
    data = image_shards(tmp_path / "d", [40, 40, 40, 40], n_test=8)
    damaged = data / "train-00003-of-00004.parquet"  # rank 1 reads files 1 and 3
    damaged.write_bytes(damaged.read_bytes()[:200])
    args = ["--dataset", "hf", "--data_dir", str(data), "--streaming", "--max_steps", "200", "--global_batch_size",
            "8", "--shuffle_buffer", "0", "--num_workers", "1", "--output_dir", str(tmp_path / "run")]
    assert main_ranks(args) == [2, 2]
    text = capfd.readouterr().err
    errors = ["accel_ddp: error:" + part.splitlines()[0] for part in text.split("accel_ddp: error:")[1:]]
    assert len(errors) == 1 and str(damaged) in errors[0] and "met by rank 1" in errors[0]


def _collate_with_a_bug(samples):  # a user's collate_fn; forked ranks and their workers inherit RANK
    if os.environ.get("RANK") == "1" and any(int(x) == 24 for x, _ in samples):  # rank 1's third micro-batch
        raise TypeError("_collate_with_a_bug cannot batch these samples")
    return torch.utils.data.default_collate(samples)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bug_in_a_collate_fn_while_streaming_is_raised_with_its_traceback_and_stops_every_rank(
        tmp_path, workers):
    """Not bad data: rank 1 raises the TypeError itself, traceback and all; rank 0 stops at the same step and
    names rank 1. Neither says "check the source"."""
    files = write_shards(tmp_path / "s", [20, 20, 20, 20])  # rank 1 reads files 1 and 3: examples 20.. first

    def run():
        import traceback

        import datasets
        from accelerate import PartialState

        from accel_ddp.data.streaming import StreamingLoader, StreamSource

        state = PartialState(cpu=True)
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        loader = StreamingLoader(StreamSource(stream, _decode_idx, 0), 2, 4, max_steps=10, seed=0,
                                 rank=state.process_index, world_size=2, num_workers=workers,
                                 collate_fn=_collate_with_a_bug)
        trained = 0
        try:
            for _ in loader:
                trained += 1
        except Exception as err:  # noqa: BLE001 - what each rank raised goes back to the test
            return trained, type(err).__name__, str(err), traceback.format_exc()
        return trained, None, None, None

    (steps0, kind0, text0, _), (steps1, kind1, text1, trace1) = run_ranks(run, grace=5)
    assert (steps0, steps1) == (2, 2)  # both stopped before the step rank 1 could not batch
    assert kind1 == "TypeError" and "_collate_with_a_bug" in trace1 and "cannot batch these samples" in text1
    assert kind0 == "PeerFailed" and "rank 1" in text0 and "TypeError" in text0  # a RuntimeError: never first
    assert "check the source" not in text0 + text1


@pytest.mark.parametrize("args,expected", [
    (["--streaming", "--max_steps", "5"], "add --dataset hf"),
    (["--dataset", "hf", "--streaming"], "set --max_steps"),
    (["--dataset", "hf", "--streaming", "--max_steps", "5", "--loader", "device"], "drop --loader"),
    (["--dataset", "hf", "--streaming", "--max_steps", "5", "--task", "causal_lm"], "drop --streaming"),
    (["--shuffle_buffer", "-1"], "--shuffle_buffer must be >= 0"),
])
def test_streaming_options_that_cannot_work_are_one_clear_error(args, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_args(args)


def _noisy_rows(batch):  # a datasets transform drawing random numbers, as augmentation pipelines do
    return {"x": [torch.tensor([float(i), float(torch.rand(()))]) for i in batch["i"]], "label": batch["label"]}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_datasets_dataset_with_a_random_transform_reads_memory_mapped_and_seeded(tmp_path, workers):
    """A user's datasets.Dataset (dict rows, set_transform) goes through the DataLoader path memory-mapped, read a
    batch at a time with the generators seeded from the batch's position: the same draws with or without workers."""
    import datasets

    datasets.Dataset.from_dict({"i": list(range(40)), "label": [i % 2 for i in range(40)]}).save_to_disk(tmp_path / "d")
    table = datasets.load_from_disk(str(tmp_path / "d"))
    table.set_transform(_noisy_rows)
    assert data_source(table) == "memory_mapped"

    def draws(num_workers: int) -> dict[int, float]:
        loader = HostLoader(table, 4, 8, seed=2, num_workers=num_workers)
        return {int(i): noise for batch in loader for i, noise in batch["x"].tolist()}

    seen = draws(workers)
    assert len(seen) == 40 and seen == draws(0)


def test_streaming_resumed_on_another_world_size_restarts_the_pass_with_a_warning(tmp_path,
                                                                                 capfd):
    """Reader positions belong to a world size: on another one the pass starts over (said once), nothing is lost."""
    files = write_shards(tmp_path / "s", [20, 20, 20, 20])
    saved = tmp_path / "3"
    saved.mkdir()
    _stream(files, 2, max_steps=12, workers=0, stop_after=3, save_to=saved)  # the 1-rank run reads rank 0's
    capfd.readouterr()
    [rest] = _stream(files, 1, max_steps=12, workers=0, per_device=4, resume_from=saved)
    assert capfd.readouterr().err.count("starts over") == 1
    first_pass = [i for data_epoch, ids in rest if data_epoch == 0 for i in ids]
    assert sorted(first_pass) == list(range(80))[:len(first_pass)] and len(first_pass) == 36  # 9 steps of 4


def test_streaming_resumed_on_more_ranks_puts_every_rank_in_the_saved_pass(tmp_path, capfd):
    """Saved by 2 ranks in their second pass, resumed by 3: every rank, the new one too (it has no saved position),
    restarts that same pass (one shuffle, each example at most once), said once; nobody waits on another."""
    files = write_shards(tmp_path / "s", [20, 20, 20, 20])  # 2 ranks: 2 files each, 20 steps of 2 per pass
    saved = tmp_path / "23"
    saved.mkdir()
    first = _stream(files, 2, max_steps=30, buffer=8, workers=0, stop_after=23, save_to=saved)
    assert {data_epoch for rank in first for data_epoch, _ in rank[20:]} == {1}
    capfd.readouterr()
    rest = _stream(files, 3, max_steps=30, buffer=8, workers=0, resume_from=saved)
    assert [[data_epoch for data_epoch, _ in rank] for rank in rest] == [[1] * 7] * 3
    assert capfd.readouterr().err.count("starts over") == 1
    ids = _passes(rest)[1]
    assert len(ids) == 42 and len(set(ids)) == 42


def test_packed_text_trains_the_same_weights_in_memory_and_memory_mapped_with_workers_or_without(tmp_path,
                                                                                                 monkeypatch):
    """Packed text fits in memory: the device loader serves its blocks (no worker, no attention mask), or a
    DataLoader with --loader dataloader. Kept memory-mapped (--device_loader_max_mb 0: the datasets cache read
    through DataLoader workers, batches with an all-ones attention mask), it trains the same weights, with
    workers or without, dropout included."""
    pytest.importorskip("transformers")
    import datasets

    from tests.helpers.text import build_word_tokenizer, lm_args

    texts = tmp_path / "corpus" / "texts"
    texts.mkdir(parents=True)
    words = ["the", "food", "was", "good", "bad", "very", "service", "slow"]
    rng = np.random.default_rng(0)
    lines = {split: [" ".join(rng.choice(words, 8)) for _ in range(n)] for split, n in (("train", 160), ("test", 21))}
    for split, rows in lines.items():
        (texts / f"{split}.json").write_text("".join(f'{{"text": "{text}"}}\n' for text in rows))
    build_word_tokenizer(lines["train"], tmp_path / "corpus" / "tokenizer")
    (tmp_path / "corpus" / "gpt2.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, '
                                                   '"n_positions": 64, "vocab_size": 8}')
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    flags = {"w0": ["--device_loader_max_mb", "0", "--num_workers", "0"],
             "w1": ["--device_loader_max_mb", "0", "--num_workers", "1"], "memory": [],
             "memory_dataloader": ["--loader", "dataloader"]}
    summaries = train_ranks_in_turn([lm_args(tmp_path / "corpus", tmp_path / name, "--packing", "--max_steps", "6",
                                             *more) for name, more in flags.items()])  # the same forked ranks
    runs = {name: by_rank[0] for name, by_rank in zip(flags, summaries, strict=True)}
    assert (runs["w1"]["loader"], runs["w1"]["data_source"]) == ("dataloader", "memory_mapped")
    assert (runs["memory"]["loader"], runs["memory"]["data_source"]) == ("device", "in_memory")
    assert (runs["memory_dataloader"]["loader"], runs["memory_dataloader"]["data_source"]) == ("dataloader",
                                                                                               "in_memory")
    without = load_weights(tmp_path / "w0")
    for name in ("w1", "memory", "memory_dataloader"):
        weights = load_weights(tmp_path / name)
        assert all(torch.equal(weights[k], without[k]) for k in without), name
