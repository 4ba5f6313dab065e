"""--per_device_batch_size auto on two forked ranks: a model that runs out of memory above a micro-batch size.

``oom_model``'s training forward raises ``torch.OutOfMemoryError`` (what the CUDA caching allocator raises) when its
batch holds more than ``_OOM["above"]`` samples on the ranks in ``_OOM["ranks"]``, and records the size of every
training forward. The reference for each auto run is the same run started with ``--per_device_batch_size`` at the
size the probe chose: weights equal bit for bit (the probe's gradients are dropped, its random draws, dropout's
here, and the batch norm statistics it moved are put back), summary and every logged loss the same.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from accel_ddp.cli.train import main
from accel_ddp.config import TrainConfig
from accel_ddp.config.views import section_of
from accel_ddp.util.validation import ConfigError
from tests.helpers import faults
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import load_weights, read_metrics, read_summary

# 16 samples per rank per optimizer step: the probe tries 16, 8, 4 against a model that fits 4 (or 5: 16, 8, 4).
ARGS = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
        "--model", "tests.test_auto_batch:oom_model", "--global_batch_size", "32", "--max_steps", "6",
        "--log_every", "1", "--lr", "0.01", "--eval_every", "3"]
_OOM: dict = {}  # this rank's: the largest batch that fits, the ranks that run out of memory, the sizes seen


def oom_model(num_classes: int, input_shape: tuple[int, ...]):
    """Batch norm (buffers the probe moves), dropout (random draws it makes) and two layers; out of memory in a
    training forward of more than _OOM["above"] samples on the ranks _OOM["ranks"]."""
    import math

    from torch import nn

    width = math.prod(input_shape)
    norm = nn.Identity() if _OOM.get("no_batch_norm") else nn.BatchNorm1d(width)  # which needs 2 samples or more
    model = nn.Sequential(nn.Flatten(), norm, nn.Dropout(0.2), nn.Linear(width, 16), nn.ReLU(),
                          nn.Linear(16, num_classes))

    def out_of_memory(module, args):
        if not (module.training and torch.is_grad_enabled()):  # the set-up probe's eval forward, evaluations
            return
        size = args[0].shape[0]
        _OOM.setdefault("seen", []).append(size)
        if size > _OOM.get("above", size) and int(os.environ.get("RANK", "0")) in _OOM.get("ranks", ()):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} MiB (injected)")

    model.register_forward_pre_hook(out_of_memory)
    return model


def _run(args: list[str], above: int | None = None, ranks=(0, 1), fail_at=None, **model):
    """main(args) on every rank with the fault; each rank's (exit code, training forward sizes)."""
    def rank():
        _OOM.clear()
        _OOM.update({"above": above, "ranks": ranks, **model} if above is not None else model)
        if fail_at is not None:
            faults.install(fail_at=fail_at)
        return main(args), _OOM.get("seen", [])

    return run_ranks(rank)


@pytest.fixture(scope="module")
def at_4(tmp_path_factory) -> Path:
    """The reference of the auto runs below that end at 4 (x 4 accumulation): ARGS started at 4, trained once for the
    module (it is the same run for each of them)."""
    ref = tmp_path_factory.mktemp("at_4") / "ref"
    assert [code for code, _ in _run([*ARGS, "--per_device_batch_size", "4", "--output_dir", str(ref)])] == [0, 0]
    return ref


def _same_run(out, ref) -> None:
    auto_weights, ref_weights = load_weights(out), load_weights(ref)
    assert auto_weights.keys() == ref_weights.keys()
    for name in ref_weights:  # bit for bit: the same micro-batches, the same RNG stream, the same buffers
        assert torch.equal(auto_weights[name], ref_weights[name]), name
    losses = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(out)]
    assert losses == [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(ref)]


@pytest.mark.parametrize("ranks", [(0, 1), (1,)], ids=["both_ranks", "rank_1_only"])
def test_auto_halves_until_every_rank_fits_and_trains_as_a_run_started_there(tmp_path, ranks, at_4):
    out = tmp_path / "auto"
    results = _run([*ARGS, "--per_device_batch_size", "auto", "--output_dir", str(out)], above=4, ranks=ranks)
    assert [code for code, _ in results] == [0, 0]
    # Every rank tried every size (one agreed answer per size): one micro-step at 16 (no accumulation there), two
    # at 8 and 4, a rank that runs out of memory stopping at the first; then it trained at 4 only.
    for rank, (_, seen) in enumerate(results):
        assert seen[:-24] == ([16, 8] if rank in ranks else [16, 8, 8]) + [4, 4]
        assert seen[-24:] == [4] * 6 * 4  # 6 steps x 4 accumulation
    summary = read_summary(out)
    assert (summary["per_device_batch_size"], summary["grad_accum_steps"]) == (4, 4)
    assert summary["auto_batch"] == {"requested": "auto", "tried": [16, 8, 4], "from": "probe"}
    _same_run(out, at_4)


def test_a_cap_starts_the_probe_below_the_share_and_a_size_that_fits_is_kept(tmp_path):
    out = tmp_path / "auto"
    results = _run([*ARGS, "--per_device_batch_size", "auto:5", "--output_dir", str(out)], above=8)
    assert [code for code, _ in results] == [0, 0]
    assert all(set(seen) == {4} for _, seen in results)  # 5 does not divide 16: 4 is the largest that does
    summary = read_summary(out)
    layout = (summary["per_device_batch_size"], summary["grad_accum_steps"], summary["auto_batch"]["tried"])
    assert layout == (4, 4, [4])


def test_a_resume_reuses_the_recorded_size_without_probing(tmp_path, at_4):
    """The run fails after step 4 (checkpoint at step 2); the resume trains at the checkpoint's size, never above."""
    out = tmp_path / "auto"
    args = [*ARGS, "--per_device_batch_size", "auto", "--output_dir", str(out), "--checkpointing_steps", "2"]
    assert [code for code, _ in _run(args, above=4, fail_at=(4, 1))] == [1, 1]
    results = _run([*args, "--resume_from_checkpoint", "auto"], above=4)
    _resumed_at_the_recorded_size(results, out, at_4)


def _resumed_at_the_recorded_size(results, out, ref) -> None:
    """The resume from step 2 trained at the checkpoint's 4 (x 4 accumulation), no probe, as a run started at 4."""
    assert [code for code, _ in results] == [0, 0]
    assert all(set(seen) == {4} and len(seen) == 4 * 4 for _, seen in results)  # steps 3-6 only, no probe
    summary = read_summary(out)
    assert (summary["resumed_from_step"], summary["per_device_batch_size"], summary["grad_accum_steps"]) == (2, 4, 4)
    assert summary["auto_batch"] == {"requested": "auto", "tried": [], "from": "checkpoint"}
    _same_run(out, ref)


@pytest.mark.parametrize("ranks", [(0, 1), (1,)], ids=["both_ranks", "rank_1_only"])
def test_a_micro_batch_of_one_that_does_not_fit_is_one_line_and_exit_2_on_every_rank(tmp_path, capfd, ranks):
    out = tmp_path / "auto"
    capfd.readouterr()
    results = _run([*ARGS, "--per_device_batch_size", "auto", "--output_dir", str(out)], above=0, ranks=ranks,
                   no_batch_norm=True)
    assert [code for code, _ in results] == [2, 2]
    for rank, (_, seen) in enumerate(results):
        assert seen == ([16, 8, 4, 2, 1] if rank in ranks else [16, 8, 8, 4, 4, 2, 2, 1, 1])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("accel_ddp: error:")]
    assert lines == ["accel_ddp: error: --per_device_batch_size auto: a micro-batch of 1 does not fit in memory on "
                     "some rank (tried 16, 8, 4, 2, 1); use a smaller model, --mixed_precision bf16, or a device with "
                     "more memory"], err
    assert "Traceback" not in err
    assert not (out / "summary.json").exists() and not (out / "checkpoints").exists()


def test_running_out_of_memory_later_in_training_is_one_line_naming_the_flag(tmp_path, capfd):
    """The probe decides once, at start: a step that needs more later is a failure, with the flag to change."""
    out = tmp_path / "fixed"

    def rank():
        _OOM.clear()
        calls = [0]

        def later(module, args):  # rank 1's 9th training forward (step 3's first micro-step) runs out of memory
            calls[0] += module.training and torch.is_grad_enabled()
            if int(os.environ.get("RANK", "0")) == 1 and calls[0] == 9 and module.training:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

        import accel_ddp.assemble as assemble

        build = assemble.build_configured_model

        def with_fault(*args, **kwargs):
            model = build(*args, **kwargs)
            model.register_forward_pre_hook(later)
            return model

        assemble.build_configured_model = with_fault
        return main([*ARGS, "--per_device_batch_size", "4", "--output_dir", str(out)])

    capfd.readouterr()
    assert run_ranks(rank) == [2, 2]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("accel_ddp: error:")]
    assert lines == ["accel_ddp: error: out of device memory in optimizer step 3 with --per_device_batch_size 4 x 4 "
                     "accumulation steps; give a smaller --per_device_batch_size that divides each rank's share of "
                     "the global batch (the global batch, and so the training, stays the same), or "
                     "--per_device_batch_size auto to find the largest that fits at start"], err
    assert "Traceback" not in err


@pytest.mark.parametrize(("value", "layout"), [("auto", (16, 1)), ("auto:6", (4, 4)), ("auto:100", (16, 1)),
                                               ("auto:1", (1, 16))])
def test_auto_starts_at_the_largest_divisor_of_the_share(value, layout):
    assert TrainConfig(per_device_batch_size=value, global_batch_size=32).batch_layout(2) == layout


@pytest.mark.parametrize("value", ["autox", "auto:0", "auto:", "auto:-2", "Auto", 2.5, "16"])
def test_bad_per_device_values_are_refused(value):
    with pytest.raises(ConfigError, match="--per_device_batch_size"):
        TrainConfig(per_device_batch_size=value)


def test_auto_with_gradient_accumulation_steps_is_refused():
    with pytest.raises(ConfigError, match="auto derives the accumulation"):
        TrainConfig(per_device_batch_size="auto", gradient_accumulation_steps=4)


@pytest.mark.parametrize("world", [1, 2])
def test_the_python_api_on_text_with_token_exact_losses(tmp_path, world):
    """train(TrainConfig(per_device_batch_size="auto"), model=...) on causal_lm sequences of 3 to 16 tokens (each
    micro-batch padded to its longest, a (sum, num_items) loss): the probe picks 1 and the run is the run at 1."""
    from accel_ddp import train
    from tests.helpers.text import Sequences, tiny_gpt

    def run(out, per_device, above=None):
        def fn():
            torch.manual_seed(0)
            model = tiny_gpt()
            seen = []

            def out_of_memory(module, args, kwargs):
                size = kwargs["input_ids"].shape[0]
                if module.training and torch.is_grad_enabled():
                    seen.append(size)
                    if above is not None and size > above:
                        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

            model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
            config = TrainConfig(task="causal_lm", global_batch_size=8, per_device_batch_size=per_device, max_steps=3,
                                 optimizer="sgd", lr=0.2, lr_schedule="constant", log_every=2, output_dir=str(out))
            return train(config, model=model, train_dataset=Sequences(96)), seen

        return run_ranks(fn, world_size=world)

    share = 8 // world
    results = run(tmp_path / "auto", "auto", above=1)
    summary = results[0][0]
    assert (summary["per_device_batch_size"], summary["grad_accum_steps"]) == (1, share)
    assert summary["auto_batch"]["tried"] == [size for size in (8, 4, 2, 1) if size <= share]
    assert all(seen[-3 * share:] == [1] * 3 * share for _, seen in results)
    run(tmp_path / "ref", 1)
    _same_run(tmp_path / "auto", tmp_path / "ref")


def test_the_command_line_and_the_hugging_face_name_take_auto():
    from accel_ddp.cli.args import parse_args

    assert parse_args(["--per_device_batch_size", "auto:8"]).per_device_batch_size == "auto:8"
    assert parse_args(["--per_device_train_batch_size", "auto"]).auto_batch
    assert parse_args(["--per_device_batch_size", "8"]).per_device_batch_size == 8


def test_a_resume_from_an_object_store_reuses_the_recorded_size(s3, tmp_path, at_4):
    """--checkpoint_dir s3://...: the sealed checkpoints are in the store, OUTPUT_DIR/checkpoints holds only staging.
    The resume (auto: the store's newest sealed one; or that checkpoint's URL) trains at its size, never probing.
    The failed run is made once; each resume starts from a copy of its folder and of its objects."""
    from tests.helpers.s3 import BUCKET, new_prefix

    failed, prefix = tmp_path / "failed", new_prefix()
    args = [*ARGS, "--per_device_batch_size", "auto", "--checkpointing_steps", "2"]
    assert [code for code, _ in _run([*args, "--output_dir", str(failed), "--checkpoint_dir",
                                      f"s3://{BUCKET}/{prefix}"], above=4, fail_at=(4, 1))] == [1, 1]
    for spec in ("auto", "step_00000002"):
        out, copy = tmp_path / spec, new_prefix()
        shutil.copytree(failed, out)
        for obj in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["Contents"]:
            s3.copy_object(Bucket=BUCKET, Key=copy + obj["Key"][len(prefix):],
                           CopySource={"Bucket": BUCKET, "Key": obj["Key"]})
        url = f"s3://{BUCKET}/{copy}"
        resume = "auto" if spec == "auto" else f"{url}/{spec}"
        results = _run([*args, "--output_dir", str(out), "--checkpoint_dir", url, "--resume_from_checkpoint", resume],
                       above=4)
        _resumed_at_the_recorded_size(results, out, at_4)


def test_a_streamed_probe_measures_batches_of_the_candidate_size(tmp_path):
    """A stream's source holds only the rows read at start-up: the probe repeats them up to each candidate size,
    so a model that runs out of memory above 4 gets 4, not the first candidate, 16, which a step then could not run."""
    from tests.helpers.data import image_shards

    data = image_shards(tmp_path / "d", [48, 48], n_test=4)
    args = ["--dataset", "hf", "--data_dir", str(data), "--streaming", "--shuffle_buffer", "0", "--num_workers", "0",
            "--model", "tests.test_auto_batch:oom_model", "--global_batch_size", "32", "--max_steps", "2",
            "--per_device_batch_size", "auto", "--output_dir", str(tmp_path / "run")]
    results = _run(args, above=4)
    assert [code for code, _ in results] == [0, 0]
    for _, seen in results:
        assert seen[:-8] == [16, 8, 4, 4] and seen[-8:] == [4] * 2 * 4  # the probe's full-size batches, then 2 steps
    summary = read_summary(tmp_path / "run")
    assert (summary["per_device_batch_size"], summary["grad_accum_steps"]) == (4, 4)


def test_the_probe_samples_repeat_a_short_source_up_to_the_size():
    from accel_ddp.auto_batch import probe_samples

    assert probe_samples(list(range(3)), 8) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert probe_samples(list(range(10)), 4) == [0, 1, 2, 3]


@pytest.mark.parametrize(("loader", "on_device"), [("auto", True), ("device", True), ("dataloader", False)])
def test_the_probe_reserves_the_memory_of_data_the_device_loader_will_hold(monkeypatch, loader, on_device):
    """On an accelerator the device loader moves the training set (and this rank's share of the eval set) there
    after the probe: the probe holds those bytes beside the optimizer's state. Run on the meta device (no GPU here):
    its type is not the CPU's, and fork_rng leaves it alone."""
    from types import SimpleNamespace

    import accel_ddp.auto_batch as auto_batch
    from accel_ddp.data import InMemoryDataset
    from accel_ddp.data.resolve import Data

    train = InMemoryDataset(torch.zeros(64, 1, 8, 8), torch.zeros(64, dtype=torch.long))
    held = InMemoryDataset(torch.zeros(10, 1, 8, 8), torch.zeros(10, dtype=torch.long))
    data = Data(train, held, 4, (1, 8, 8))
    options = section_of(TrainConfig(per_device_batch_size="auto", global_batch_size=32, loader=loader),
                         auto_batch.AutoBatchOptions)
    accelerator = SimpleNamespace(device=torch.device("meta"), num_processes=1)
    reserves = []
    monkeypatch.setattr(auto_batch, "_fits", lambda *args: reserves.append(args[-1]) or True)
    model = oom_model(4, (1, 8, 8))
    state = auto_batch._state_bytes(options, model, 1)
    chosen = auto_batch._probe(options, accelerator, model, None, data)
    assert (chosen.size, chosen.tried) == (32, [32])
    assert reserves == [state + (train.nbytes + held.nbytes if on_device else 0)]
    accelerator.device = torch.device("cpu")  # host memory: not what the probe measures
    assert auto_batch.device_data_bytes(options, accelerator, data) == 0


@pytest.mark.parametrize(("device", "fork"), [
    ("cpu", {"devices": []}),
    ("cuda:1", {"devices": [torch.device("cuda:1")], "device_type": "cuda"}),
    ("mps", {"devices": [torch.device("mps")], "device_type": "mps"}),
    ("xpu:0", {"devices": [torch.device("xpu:0")], "device_type": "xpu"}),
])
def test_the_probe_forks_the_generators_of_the_device_in_use(device, fork):
    from accel_ddp.auto_batch import rng_fork

    assert rng_fork(torch.device(device)) == fork
