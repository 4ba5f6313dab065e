"""The guarantee matrix: each guarantee on every path it claims (docs/DESIGN: "Every guarantee holds on every path
it claims"): the device loader, a DataLoader with workers, memory-mapped, streaming, text (causal_lm).

Forked ranks (tests/helpers_ranks.py): each rank runs the CLI's ``main()`` with its own torchelastic error file,
and the other rank gets torchrun's SIGTERM once one has exited; what each rank prints is visible to ``capfd``.
"""

from __future__ import annotations

import pytest

from accel_ddp.data.hf import STATS_SAMPLE, stats_rows
from tests import helpers_data
from tests.helpers_ranks import assert_quiet, error_lines, launch_ranks, recorded

PATHS = ["device", "workers", "mapped", "streaming", "text"]


# ============================================================================ errors
#
# (a) A sample that does not decode, met by rank 1 at optimizer step 3 (one rank only): exactly one
#     `accel_ddp: error:` line naming it, every rank exits 2, no traceback anywhere, no hang. On the device loader
#     path every sample is decoded into memory before training: there the bad sample is met by every rank at
#     start-up, which is the earliest it can be known.
# (b) An exception on rank 1 right after step 2: every rank stops promptly (none is let go before every rank
#     reported: a rank that cannot learn of the failure hangs the test), the failing rank's traceback is shown
#     once, the other rank prints nothing, both exit 1, and the other's error file names rank 1.

BATCH = ["--global_batch_size", "8", "--max_steps", "60"]  # far more steps than a test lets a run take


class Paths:
    """Each path's data, built once per module in ``root``: ``args(path, bad)`` and the bad sample's name."""

    def __init__(self, root):
        self.root, self.built = root, {}

    def args(self, path: str, bad: bool) -> tuple[list[str], str]:
        key = (path, bad or path in ("workers", "mapped", "streaming"))  # (b) stops before their bad sample
        if key not in self.built:
            self.built[key] = getattr(self, f"_{path}")(self.root / f"{path}-{int(key[1])}", key[1])
        return self.built[key]

    def _device(self, folder, bad):  # hf, small enough to decode into memory: the device loader
        helpers_data.image_splits(folder, 40, 8, bad_rows=(13,) if bad else ())
        return ["--dataset", "hf", "--data_dir", str(folder), "--loader", "device", *BATCH], \
            "hf: row 13 of the 'train' split does not decode as an image"

    def _workers(self, folder, bad):  # an image folder: decoded per sample by a DataLoader worker
        from torchvision.datasets import ImageFolder

        helpers_data.write_png_classes(folder / "train", ["a", "b"], per_class=20, size=(8, 8))
        helpers_data.write_png_classes(folder / "val", ["a", "b"], per_class=2, size=(8, 8))
        path = ImageFolder(str(folder / "train")).samples[helpers_data.read_at(3, 1, 40, 8, 2)][0]
        with open(path, "wb") as fh:
            fh.write(b"not an image")
        return ["--dataset", "imagefolder", "--data_dir", str(folder), "--num_workers", "1", *BATCH], \
            f"imagefolder: {path} does not decode as an image"

    def _mapped(self, folder, bad):  # hf above the in-memory threshold: memory-mapped, decoded in a worker
        rows = STATS_SAMPLE + 100  # start-up decodes 1024 rows for the normalisation: the bad one is not among them
        decoded_first = set(stats_rows(rows).tolist())
        row = next(row for step in range(3, rows // 8) for row in helpers_data.reads_at(step, 1, rows, 8, 2)
                   if row not in decoded_first)  # rank 1 meets it at step 3 or later
        helpers_data.image_splits(folder, rows, 16, bad_rows=(row,))
        return ["--dataset", "hf", "--data_dir", str(folder), "--device_loader_max_mb", "0", "--num_workers", "1",
                "--checkpointing_steps", "2", *BATCH], f"hf: row {row} of the 'train' split does not decode"

    def _streaming(self, folder, bad):  # parquet files, streamed: rank 1 reads files 1 and 3 (its 9th example)
        helpers_data.image_shards(folder, [STATS_SAMPLE, 8, 8, 8], n_test=8, bad_rows={3: (0,)})
        return ["--dataset", "hf", "--data_dir", str(folder), "--streaming", "--shuffle_buffer", "0",
                "--num_workers", "1", *BATCH], "hf: example 8 read by worker 0 of rank 1 of the 'train' split does not"

    def _text(self, folder, bad):  # token sequences for a GPT-2 (causal_lm), padded per batch, read by a worker
        folder.mkdir()
        dataset = "tests.helpers_data:sequences_one_bad" if bad else "tests.test_tasks:build_sequences"
        return ["--task", "causal_lm", "--dataset", dataset, "--model", "tests.test_tasks:build_gpt",
                "--num_workers", "1", *BATCH], helpers_data.BAD_SAMPLE_MESSAGE


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> Paths:
    return Paths(tmp_path_factory.mktemp("paths"))


@pytest.fixture
def quick_stream_ends(monkeypatch):
    """datasets sleeps 5 s once a parquet stream's reader threads end (apache/arrow#45214); a fraction is plenty."""
    import datasets

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0.2)


@pytest.mark.parametrize("path", PATHS)
def test_a_bad_sample_is_one_line_and_exit_2_on_every_rank(paths, path, tmp_path, capfd, quick_stream_ends):
    args, sample = paths.args(path, bad=True)
    out = tmp_path / "run"
    assert launch_ranks(tmp_path, [*args, "--output_dir", str(out)]) == [2, 2]
    err = capfd.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and sample in lines[0], err
    assert_quiet(err)
    first = 0 if recorded(tmp_path, 0)["message"].startswith("DataError") else 1
    assert recorded(tmp_path, first)["message"] == "DataError: " + lines[0].removeprefix("accel_ddp: error: ")
    assert recorded(tmp_path, 1 - first)["message"].startswith(f"stopped because rank {first} failed: DataError: ")
    if path not in ("device", "streaming"):  # met by rank 1 alone (a stream stops every rank with rank 1's line)
        assert first == 1
    assert not (out / "summary.json").exists() and not (out / "model.safetensors").exists()
    if path == "mapped":  # the checkpoint of step 2, saved before, is intact
        from accel_ddp.checkpoint import list_checkpoints, read_checkpoint

        assert [step for step, _ in list_checkpoints(out / "checkpoints")] == [2]
        read_checkpoint(str(out / "checkpoints" / "step_00000002"))  # every file as saved (sizes and sha256)


@pytest.mark.parametrize("path", PATHS)
def test_a_failing_rank_stops_every_rank_with_its_traceback_once(paths, path, tmp_path, capfd, quick_stream_ends):
    args, _ = paths.args(path, bad=False)
    assert launch_ranks(tmp_path, [*args, "--output_dir", str(tmp_path / "run")], fail_at=(2, 1)) == [1, 1]
    err = capfd.readouterr().err
    injected = "InjectedFailure: injected failure on rank 1 at step 2"
    assert err.count("Traceback (most recent call last)") == 1 and injected in err, err
    assert error_lines(err) == []
    assert "Connection closed by peer" not in err and "frame #" not in err
    assert recorded(tmp_path, 1)["message"] == injected
    assert recorded(tmp_path, 0)["message"] == f"stopped because rank 1 failed: {injected}"
