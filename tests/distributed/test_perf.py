"""Performance knobs are really applied, and the loop logs its own timing figures."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import accel_ddp.lifecycle.preemption
from accel_ddp import TrainConfig, train
from accel_ddp.assemble import build_world
from accel_ddp.checkpoint.weights import load_weights
from accel_ddp.cli.args import parse_args
from accel_ddp.loop import setup
from accel_ddp.models import build_model
from tests.helpers.multiproc import RankFailed, run_ranks
from tests.helpers.runs import check, gpu_env, launch, read_metrics, read_summary, run_python, train_ranks


@pytest.fixture(scope="module", autouse=True)
def _inductor_imported_once():
    """torch.compile's first call in a process imports inductor (~1.8 s of CPU, ~580 modules), before anything
    compiles: here the test process pays it once, and the ranks this module forks to compile inherit it (each of the
    five processes that compiled paid it before). Then frozen, as conftest freezes what the test process loaded: the
    garbage collections of every rank forked later walk none of it."""
    import gc

    torch.compile(nn.Linear(1, 1))
    gc.collect()
    gc.freeze()


def _ddp_facts(flags: list[str]) -> dict:
    """Build the accelerator from train.py's flags, prepare a small model, report what DDP really got."""
    accelerator, _, _ = build_world(parse_args(flags))
    model = accelerator.prepare(build_model("mlp", num_classes=3, input_shape=(5,), hidden_size=8))
    ddp = getattr(model, "_orig_mod", model)  # under --compile the DDP module sits inside the compiled wrapper
    return {
        "wrapper": type(model).__name__,
        "ddp": type(ddp).__name__,
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": ddp.static_graph,
        "find_unused_parameters": ddp.find_unused_parameters,
        "comm_hook": ddp._get_ddp_logging_data().get("comm_hook"),
    }


def _inspect(*flags: str) -> dict:
    """``_ddp_facts`` on two forked ranks of a gloo group; rank 0's answer (the ranks agree)."""
    facts = run_ranks(lambda: _ddp_facts(list(flags)), world_size=2)
    assert facts[0] == facts[1]
    return facts[0]


def test_ddp_knobs_reach_the_ddp_module_and_compile_wraps_it():
    defaults = _inspect()
    assert defaults["wrapper"] == defaults["ddp"] == "DistributedDataParallel"
    assert defaults["bucket_cap_bytes"] == 25 * 1024 * 1024
    assert defaults["gradient_as_bucket_view"] is True  # our default: no extra gradient copy
    assert defaults["static_graph"] is False and defaults["find_unused_parameters"] is False
    assert defaults["comm_hook"] in (None, "", "builtin_allreduce")

    tuned = _inspect("--ddp_bucket_cap_mb", "7", "--ddp_gradient_as_bucket_view", "false",
                     "--ddp_static_graph", "--ddp_comm_hook", "fp16")
    assert tuned["bucket_cap_bytes"] == 7 * 1024 * 1024
    assert tuned["gradient_as_bucket_view"] is False and tuned["static_graph"] is True
    assert tuned["comm_hook"] == "fp16_compress_hook"

    # --compile wraps the DDP module, whose knobs stay as given (one pair of ranks shows both)
    other = _inspect("--ddp_find_unused_parameters", "--ddp_comm_hook", "bf16", "--compile")
    assert other["wrapper"] == "OptimizedModule" and other["ddp"] == "DistributedDataParallel"
    assert other["find_unused_parameters"] is True and other["comm_hook"] == "bf16_compress_hook"


def _barrier_with_a_late_rank() -> str:
    # 1 s, the option's least: whichever collective rank 1's sleep leaves waiting (the barrier, or under load one in
    # build_world), it times out on rank 0 after --ddp_timeout, not gloo's 30 minutes: the same outcome at any load
    accelerator, _, _ = build_world(parse_args(["--ddp_timeout", "1"]))
    if accelerator.process_index == 1:
        time.sleep(60)
    accelerator.wait_for_everyone()
    return "barrier passed"


@pytest.mark.slow
def test_process_group_timeout_fails_a_missing_rank_fast():
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(_barrier_with_a_late_rank, world_size=2, timeout=120, grace=1)
    elapsed = time.monotonic() - started
    assert 0 in failed.value.failures and "barrier passed" not in str(failed.value)
    assert elapsed < 45, f"a 1 s timeout took {elapsed:.0f}s to end the job"
    assert "timed out" in failed.value.failures[0].lower() or "timeout" in failed.value.failures[0].lower()


class _NcclLikeDist:
    """torch.distributed as a GPU run's preemption watcher sees it: the default group is NCCL."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def get_backend(group=None) -> str:
        return "nccl"


def _flag_with_a_late_rank(output_dir: str) -> str:
    accel_ddp.lifecycle.preemption.dist = _NcclLikeDist()  # this forked rank only: the flag gets its own gloo group
    args = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--model", "mlp",
            "--hidden_size", "8", "--global_batch_size", "16", "--ddp_timeout", "3", "--output_dir", output_dir]
    with ExitStack() as teardown:
        run = setup(parse_args(args), teardown)
        assert run.preemption._group is not None and run.preemption._group != dist.group.WORLD
        if run.accelerator.process_index == 1:
            time.sleep(60)
        run.preemption.stop_requested()
    return "flag passed"


@pytest.mark.slow
def test_preemption_flag_group_waits_no_longer_than_ddp_timeout(tmp_path):
    """On GPU runs the flag travels over its own gloo group; it must time out like every collective.

    Without ``--ddp_timeout`` reaching that group, rank 0 would wait gloo's default 30 minutes and
    the ranks would be killed at the 60 s ``run_ranks`` timeout instead of failing with a timeout.
    """
    with pytest.raises(RankFailed) as failed:
        run_ranks(lambda: _flag_with_a_late_rank(str(tmp_path)), world_size=2, timeout=60, grace=1)
    assert 0 in failed.value.failures and "flag passed" not in str(failed.value)
    assert "timed out" in failed.value.failures[0].lower() or "timeout" in failed.value.failures[0].lower()


def test_gradient_compression_trains_under_two_ranks(tmp_path):
    for hook in ("fp16", "bf16"):
        out = tmp_path / hook
        train_ranks(["--ddp_comm_hook", hook, "--epochs", "3", "--output_dir", str(out)])
        assert read_summary(out)["eval_accuracy"] >= 0.9, hook


MLP_KEYS = {"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}  # build_mlp's nn.Sequential


@pytest.mark.slow
def test_compiled_run_writes_plain_keys_and_resumes_across_a_compile_change(tmp_path, tiny_args):
    """--compile end to end (inductor on the CPU): weights files carry the plain model's keys.

    Accelerate 1.15 keeps torch.compile's wrapper when it unwraps, so without the fix the export has
    ``_orig_mod.1.weight`` keys that a plain model cannot load. Here one compiled run (inductor's compile is most
    of this test's time) between two plain ones: a plain run saves, the compiled run resumes from its checkpoint
    and saves, a plain run resumes from the compiled one's, and a plain model takes the compiled export through
    ``--init_from``'s loader.
    """
    run = [*tiny_args[:tiny_args.index("--epochs")], "--checkpointing_steps", "2"]
    plain, compiled, again = tmp_path / "plain", tmp_path / "compiled", tmp_path / "again"
    train_ranks([*run, "--max_steps", "2", "--output_dir", str(plain)], world_size=1)
    summary = train_ranks([*run, "--compile", "--max_steps", "4", "--output_dir", str(compiled),
                           "--resume_from_checkpoint", str(plain / "checkpoints" / "step_00000002")],
                          world_size=1, timeout=300)[0]
    assert (summary["resumed_from_step"], summary["optimizer_steps"]) == (2, 4)
    checkpoint = compiled / "checkpoints" / "step_00000004"
    for path in (compiled / "model.safetensors", checkpoint / "model.safetensors"):
        assert set(load_file(str(path))) == MLP_KEYS, path

    train_ranks([*run, "--max_steps", "6", "--resume_from_checkpoint", str(checkpoint), "--output_dir", str(again)],
                world_size=1)
    assert read_summary(again)["resumed_from_step"] == 4

    model = build_model("mlp", num_classes=10, input_shape=(1, 8, 8), hidden_size=32)
    load_weights(model, str(compiled / "model.safetensors"))  # what --init_from does
    exported = load_file(str(compiled / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], exported[k]) for k in MLP_KEYS)


def test_weights_of_compiled_models_load_either_way(tmp_path):
    """Files an earlier version exported under --compile (``_orig_mod.`` keys) load into a plain model, and a
    compiled model takes plain files (what a resume with --compile does before Accelerate compiles)."""
    from safetensors.torch import save_file

    plain = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    old = tmp_path / "old.safetensors"
    save_file({f"_orig_mod.{k}": v.clone() for k, v in plain.state_dict().items()}, str(old))
    fresh = build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8)
    load_weights(fresh, str(old))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in plain.state_dict().items())

    compiled = torch.compile(build_model("mlp", num_classes=3, input_shape=(4,), hidden_size=8))
    new = tmp_path / "new.safetensors"
    save_file({k: v.clone() for k, v in plain.state_dict().items()}, str(new))
    load_weights(compiled, str(new))
    assert all(torch.equal(compiled.state_dict()[f"_orig_mod.{k}"], v) for k, v in plain.state_dict().items())


def _export_compiled_transformer(output_dir: str) -> list[str]:
    from accelerate import Accelerator

    from accel_ddp.models import export_pretrained
    from tests.helpers.text import tiny_gpt

    accelerator = Accelerator(cpu=True, dynamo_backend="inductor")  # as build_accelerator does for --compile
    model = accelerator.prepare(tiny_gpt())  # compiled lazily: nothing compiles before a forward
    assert type(model).__name__ == "OptimizedModule"
    folder = export_pretrained(accelerator, model, None, output_dir)
    return sorted(load_file(str(Path(folder) / "model.safetensors")))


def test_compiled_transformers_model_exports_a_loadable_folder(tmp_path):
    """OUTPUT_DIR/hf_model under --compile: save_pretrained of the model with plain keys, not of the wrapper."""
    from transformers import GPT2LMHeadModel

    keys = run_ranks(lambda: _export_compiled_transformer(str(tmp_path)), world_size=1)[0]
    assert keys and not [k for k in keys if "_orig_mod" in k]
    _, info = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf_model"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


class LayoutProbe(nn.Module):
    """A conv net that records the memory format of each training batch and of its weight."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 6 * 6, 2)
        self.formats: list[tuple[bool, bool]] = []

    def forward(self, x):
        if self.training:
            self.formats.append((x.is_contiguous(memory_format=torch.channels_last),
                                 self.conv.weight.is_contiguous(memory_format=torch.channels_last)))
        return self.head(self.conv(x).flatten(1))


@pytest.mark.parametrize("channels_last", [True, False])
def test_channels_last_reaches_model_and_batches(tmp_path, channels_last):
    data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 2, (64,)))
    probe = LayoutProbe()
    cfg = TrainConfig(global_batch_size=16, epochs=1, channels_last=channels_last, output_dir=str(tmp_path))
    train(cfg, model=probe, train_dataset=data)
    assert len(probe.formats) == 4
    assert all(batch == channels_last and weight == channels_last for batch, weight in probe.formats)


@pytest.mark.gpu
def test_tf32_switches_on_with_cuda():
    result = check(run_python(
        "import torch\n"
        "from accel_ddp import TrainConfig\n"
        "from accel_ddp.assemble import build_world\n"
        "build_world(TrainConfig(tf32=True))\n"
        "print('tf32', torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)\n",
        env=gpu_env()))
    assert "tf32 True True" in result.stdout


@pytest.mark.gpu
def test_more_processes_than_gpus_stop_before_nccl(tmp_path, tiny_args):
    """Two ranks on one GPU would fail in NCCL ('Duplicate GPU detected'): every rank exits 2 first."""
    from tests.helpers.runs import gpu_count

    result = launch([*tiny_args, "--output_dir", str(tmp_path)], nproc=gpu_count() + 1, env=gpu_env())
    assert result.returncode != 0
    assert f"but only {gpu_count()} GPU(s) visible" in result.stderr and "Duplicate GPU" in result.stderr
    assert not Path(tmp_path, "config.yaml").exists()


def test_timing_figures_are_logged_per_epoch_and_in_the_summary(tmp_path):
    data = TensorDataset(torch.randn(128, 6), torch.randint(0, 3, (128,)))
    cfg = TrainConfig(global_batch_size=16, epochs=2, output_dir=str(tmp_path), profile=True)
    summary = train(cfg, model=build_model("mlp", 3, (6,), 8), train_dataset=data)
    records = read_metrics(tmp_path)
    epochs = [r for r in records if "step_time_p50_ms" in r]
    assert [r["epoch"] for r in epochs] == [0, 1] and [r["step"] for r in epochs] == [8, 16]
    for record in [*epochs, summary]:
        assert record["step_time_p90_ms"] >= record["step_time_p50_ms"] > 0
        assert 0.0 <= record["data_wait_share"] <= 1.0
    assert summary["train_samples_per_sec"] > 0
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    assert any("ProfilerStep" in str(event.get("name")) for event in trace["traceEvents"])
