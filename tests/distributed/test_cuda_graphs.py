"""--cuda_graphs (accel_ddp/step/graph.py) on the CPU: each refusal (one line, exit 2), the capturable optimizer's
LR, and the capture wrapper's bookkeeping with a stand-in for the CUDA graph whose "replay" runs the captured step
again on the captured buffers: a run through it must train exactly as the eager run does. The GPU itself (the
capture, NCCL in it, the speed) is unmeasured here: docs/performance.md."""

from __future__ import annotations

import pytest
import torch

from accel_ddp.config import TrainConfig
from accel_ddp.optim.build import build_lr_scheduler, build_optimizer
from accel_ddp.step.graph import StepGraph, copy_into, device_learning_rates, graph_problem, static_copy
from accel_ddp.util.validation import ConfigError
from tests.helpers.files import error_lines
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import load_weights, main_ranks, read_metrics

TINY = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8", "--model", "mlp",
        "--hidden_size", "32", "--global_batch_size", "32", "--epochs", "2", "--log_every", "2"]


@pytest.mark.parametrize("options, why", [
    ({"debug": True}, "--debug checks every loss on the host"),
    ({"on_anomaly": "skip"}, "--on_anomaly skip decides each step's update on the host"),
    ({"on_anomaly": "rollback", "checkpointing_steps": "4"}, "--on_anomaly rollback decides"),
    ({"dataset": "hf", "hf_name": "x/y", "streaming": True, "max_steps": 4}, "--streaming batches vary in shape"),
    ({"compile": True}, "--compile graphs the model its own way"),
    ({"optimizer": "sgd"}, "--optimizer sgd is not capturable"),
    ({"ddp_comm_hook": "bf16"}, "--ddp_comm_hook bf16 completes on host callbacks"),
    ({"loader": "dataloader"}, "--loader dataloader (without --packing)"),
    ({"gradient_checkpointing": True}, "--gradient_checkpointing reads the CUDA random state in each forward"),
    ({"gradient_checkpointing": True, "peft": "lora"}, "--gradient_checkpointing reads the CUDA random state"),
    ({"ddp_find_unused_parameters": True}, "--ddp_find_unused_parameters searches the autograd graph on the host"),
    ({"ddp_static_graph": True}, "--ddp_static_graph rebuilds DDP's buckets on the host"),
])
def test_options_whose_guarantees_a_captured_step_cannot_keep_are_refused(options, why):
    with pytest.raises(ConfigError, match="--cuda_graphs cannot keep its guarantees here") as err:
        TrainConfig(cuda_graphs=True, **options)
    assert why in str(err.value)
    TrainConfig(**options)  # without --cuda_graphs the same options are fine


def test_a_dataloader_of_packed_text_blocks_is_not_refused_by_the_options():
    assert TrainConfig(cuda_graphs=True, loader="dataloader", packing=True, task="causal_lm").cuda_graphs


def test_the_refusal_on_the_command_line_is_one_line_and_exit_2(tmp_path, capfd):
    out = tmp_path / "out"
    assert main_ranks([*TINY, "--cuda_graphs", "--debug", "--output_dir", str(out)], world_size=1) == [2]
    lines = error_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "--cuda_graphs cannot keep its guarantees here: --debug" in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--gradient_checkpointing", "--ddp_find_unused_parameters", "--ddp_static_graph"])
def test_a_clash_is_refused_before_the_device_is_looked_at_on_any_machine(flag, tmp_path, capfd):
    """On this CPU the clash's line, not "needs a CUDA device": the options are checked when they are parsed."""
    out = tmp_path / "out"
    assert main_ranks([*TINY, "--cuda_graphs", flag, "--output_dir", str(out)], world_size=1) == [2]
    lines = error_lines(capfd.readouterr().err)
    assert len(lines) == 1 and f"--cuda_graphs cannot keep its guarantees here: {flag}" in lines[0], lines
    assert "CUDA device" not in lines[0] and not out.exists()


def test_without_cuda_every_rank_refuses_with_one_line_before_writing_anything(tmp_path, capfd):
    out = tmp_path / "out"
    assert main_ranks([*TINY, "--cuda_graphs", "--output_dir", str(out)], world_size=2) == [2, 2]
    lines = error_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "--cuda_graphs needs a CUDA device (this run trains on cpu)" in lines[0], lines
    assert not out.exists() or not any(out.iterdir())


GOOD = {"device_type": "cuda", "distributed_type": "NO", "num_processes": 1, "backend": None, "accumulation": 1,
        "loader_kind": "device", "packing": False, "mixed_precision": "bf16"}


@pytest.mark.parametrize("change, why", [
    ({"device_type": "cpu"}, "needs a CUDA device (this run trains on cpu)"),
    ({"distributed_type": "FSDP"}, "captures plain or DDP steps, not FSDP"),
    ({"distributed_type": "MULTI_GPU", "num_processes": 2, "backend": "gloo"}, "needs NCCL (a gloo all-reduce"),
    ({"accumulation": 4}, "this run accumulates 4"),
    ({"loader_kind": "dataloader"}, "the dataloader path's shapes vary"),
    ({"loader_kind": "streaming", "packing": True}, "the streaming path's shapes vary"),
    ({"mixed_precision": "fp16"}, "the loss scaler checks for inf on the host"),
])
def test_each_launch_the_capture_cannot_take_is_named(change, why):
    assert why in graph_problem(**{**GOOD, **change})


@pytest.mark.parametrize("change", [{}, {"distributed_type": "MULTI_GPU", "num_processes": 4, "backend": "nccl"},
                                    {"loader_kind": "dataloader", "packing": True}, {"mixed_precision": "no"}])
def test_the_launches_it_can_capture_pass(change):
    assert graph_problem(**{**GOOD, **change}) is None


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_the_capturable_optimizer_reads_the_lr_the_schedule_updates_in_place():
    """A float LR would be baked into the captured kernels; the schedule fills this tensor before every replay."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer("adamw", model, 0.01, 0.1, capturable=True)
    assert all(g["capturable"] for g in optimizer.param_groups)
    lrs = [g["lr"] for g in optimizer.param_groups]
    assert all(isinstance(lr, torch.Tensor) for lr in lrs)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    scheduler = build_lr_scheduler(optimizer, "linear", warmup_steps=2, total_steps=10)
    first = float(lrs[0])
    scheduler.step()
    assert all(g["lr"] is lr for g, lr in zip(optimizer.param_groups, lrs, strict=True))  # the same tensors
    assert float(lrs[0]) == pytest.approx(0.01 * 2 / 3) and first == pytest.approx(0.01 / 3)
    with pytest.raises(ConfigError, match="--cuda_graphs needs --optimizer adamw"):
        build_optimizer("sgd", model, 0.01, 0.0, capturable=True)


def test_learning_rates_become_tensors_on_the_device_once_and_stay_those():
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.5)
    device_learning_rates(optimizer, torch.device("cpu"))
    lr = optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and float(lr) == 0.5
    device_learning_rates(optimizer, torch.device("cpu"))
    assert optimizer.param_groups[0]["lr"] is lr


class Rerun:
    """A stand-in for CudaGraphs on the CPU: ``capture`` keeps the function and the buffers without running it
    (as a capture records without executing), and a replay runs it again on those same buffers."""

    def __init__(self) -> None:
        self.eager_batches: list = []
        self.captures = 0

    def eager(self, fn, batch) -> None:
        self.eager_batches.append(batch)
        fn(batch)

    def capture(self, fn, static):
        self.captures += 1
        return lambda: fn(static)


def test_the_wrapper_warms_up_captures_once_then_copies_each_batch_into_the_captured_buffers():
    seen = []
    backend = Rerun()
    step = StepGraph(lambda batch: seen.append(batch["x"].clone()), warmup=2, backend=backend)
    batches = [{"x": torch.full((2, 3), float(i)), "n": 7} for i in range(5)]
    for batch in batches:
        step(batch)
    assert backend.eager_batches == batches[:2] and step.eager_steps == 2
    assert backend.captures == 1 and step.replays == 3 and step.captured
    assert [float(x[0, 0]) for x in seen] == [0, 1, 2, 3, 4]  # each step trained on its own batch
    assert step.static["x"] is not batches[2]["x"] and float(step.static["x"][0, 0]) == 4  # buffers of its own


@pytest.mark.parametrize("other", [
    {"x": torch.zeros(3, 3), "n": 7},  # another shape (a last partial batch)
    {"x": torch.zeros(2, 3, dtype=torch.float64), "n": 7},
    {"x": torch.zeros(2, 3)},  # another structure
    {"x": torch.zeros(2, 3), "n": 8},  # another constant
])
def test_a_batch_unlike_the_captured_one_is_one_line(other):
    static = static_copy({"x": torch.zeros(2, 3), "n": 7})
    with pytest.raises(ConfigError, match="--cuda_graphs: a batch"):
        copy_into(static, other)


def _train_with(args: list[str], graphs: bool):
    """``train`` on this CPU with the capture replaced by :class:`Rerun` and the CUDA-only capturable AdamW by the
    CPU's fused AdamW with a tensor LR (the same in both runs: the comparison is of the capture, not the kernels)."""
    import accel_ddp.assemble
    import accel_ddp.loop
    import accel_ddp.optim.user
    from accel_ddp.cli.args import parse_args

    backends: list[Rerun] = []

    def cpu_adamw(name, model, lr, weight_decay, fused=False, capturable=False, kwargs=None):
        groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=torch.tensor(float(lr)), fused=True)

    accel_ddp.optim.user.build_optimizer = cpu_adamw
    accel_ddp.assemble.refuse_graphs = lambda *args, **kwargs: None  # the CPU would be refused: the wiring is tested
    accel_ddp.assemble.CudaGraphs = lambda: backends.append(Rerun()) or backends[-1]  # where fit builds the step
    summary = accel_ddp.loop.train(parse_args([*args, *(["--cuda_graphs"] if graphs else [])]))
    return summary, [(b.captures, len(b.eager_batches)) for b in backends]


@pytest.mark.parametrize("world_size, warmup", [(1, 3), (2, 11)])
def test_a_run_through_the_captured_step_trains_exactly_as_the_eager_run(tmp_path, world_size, warmup):
    """Warm-up steps, the capture and every replay: weights, logged losses and the LR schedule bit for bit; under
    DDP (2 ranks; gloo here, NCCL on GPUs) after DDP's 11 eager steps, with the all-reduces replayed too."""
    runs = {}
    for graphs in (False, True):
        out = tmp_path / f"graphs_{graphs}"
        ranks = run_ranks(lambda g=graphs, o=out: _train_with([*TINY, "--output_dir", str(o)], g),
                          world_size=world_size)
        runs[graphs] = (ranks[0][0], [backends for _, backends in ranks], load_weights(out), read_metrics(out))
    (eager, no_backends, eager_weights, eager_log), (graphed, backends, graph_weights, graph_log) = runs[0], runs[1]
    assert no_backends == [[]] * world_size and backends == [[(1, warmup)]] * world_size  # one capture per rank
    assert graphed["optimizer_steps"] == eager["optimizer_steps"] == 16
    assert eager_weights.keys() == graph_weights.keys()
    assert all(torch.equal(eager_weights[k], graph_weights[k]) for k in eager_weights)
    losses = [(r["step"], r["loss"], r["lr"]) for r in eager_log if "loss" in r]
    assert len(losses) == 8 and losses == [(r["step"], r["loss"], r["lr"]) for r in graph_log if "loss" in r]


def _corpus(root):
    """Packed text for a causal LM: texts/{train,test}.json, a word tokenizer and a 2-layer GPT-2's config."""
    import json

    from tests.helpers.text import build_word_tokenizer, sentences

    (root / "texts").mkdir(parents=True)
    train, test = sentences(160, seed=0), sentences(40, seed=1)
    for split, rows in (("train", train), ("test", test)):
        (root / "texts" / f"{split}.json").write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in rows))
    build_word_tokenizer([text for text, _ in train], root / "tokenizer")
    (root / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32,
                                                "n_positions": 32, "vocab_size": 8}))
    return root


def test_the_token_exact_loss_of_packed_text_through_the_captured_step_is_the_eager_runs(tmp_path, monkeypatch):
    """The (sum, num_items) loss: the step's item count all-reduced and the gradients rescaled inside the captured
    step (2 DDP ranks), against the eager run's asynchronous count: the same weights and logged losses."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    corpus = _corpus(tmp_path / "corpus")
    lm = ["--task", "causal_lm", "--dataset", "hf", "--data_dir", str(corpus / "texts"), "--packing",
          "--tokenizer", str(corpus / "tokenizer"), "--model_config", str(corpus / "gpt2.json"), "--max_length", "16",
          "--global_batch_size", "8", "--epochs", "2", "--log_every", "2"]
    runs = {}
    for graphs in (False, True):
        out = tmp_path / f"graphs_{graphs}"
        ranks = run_ranks(lambda g=graphs, o=out: _train_with([*lm, "--output_dir", str(o)], g), world_size=2)
        runs[graphs] = (ranks[0][0], [b for _, b in ranks], load_weights(out), read_metrics(out))
    (eager, _, eager_weights, eager_log), (graphed, backends, graph_weights, graph_log) = runs[False], runs[True]
    assert graphed["loader"] == "device" and backends == [[(1, 11)]] * 2
    assert graphed["optimizer_steps"] == eager["optimizer_steps"] > 11  # replays after DDP's 11 eager steps
    assert all(torch.equal(eager_weights[k], graph_weights[k]) for k in eager_weights)
    losses = [(r["step"], r["loss"]) for r in eager_log if "loss" in r]
    assert losses and losses == [(r["step"], r["loss"]) for r in graph_log if "loss" in r]
