"""Fine-tuning (accel_ddp/transforms/finetune.py): LoRA adapters on a frozen Transformers base, activation
checkpointing under DDP, trainable-only checkpoints with the base's fingerprint, the adapter and merged exports.

The "pretrained" base is a two-layer GPT-2 written with ``save_pretrained`` into a temporary folder (no download);
the data are tests/helpers/text.py's token sequences (64 training, 16 eval). Runs are forked ranks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from accel_ddp.config import TrainConfig  # noqa: E402
from accel_ddp.util.validation import ConfigError  # noqa: E402
from tests.helpers import faults  # noqa: E402
from tests.helpers.checkpoints import assert_same_weights, steps_of  # noqa: E402
from tests.helpers.multiproc import RankFailed, run_ranks  # noqa: E402
from tests.helpers.runs import load_weights, main_ranks, read_metrics, read_summary, train_ranks  # noqa: E402
from tests.helpers.text import Sequences, tiny_gpt  # noqa: E402

DATA = ["--task", "causal_lm", "--dataset", "tests.helpers.text:build_sequences", "--num_workers", "0",
        "--log_every", "1"]
LORA = ["--peft", "lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "c_attn,c_fc"]
# 64 sequences / global batch 8 = 8 optimizer steps; AdamW at 1e-2 moves the adapters visibly in 8 steps.
STEPS = ["--global_batch_size", "8", "--max_steps", "8", "--lr", "1e-2", "--lr_schedule", "constant"]
TRAINABLE = 2 * (32 * 4 + 4 * 96) + 2 * (32 * 4 + 4 * 128)  # A (in x r) and B (r x out) of c_attn and c_fc, 2 layers


def save_base(folder: Path, dropout: float = 0.0, seed: int = 0) -> Path:
    """A tiny GPT-2 written with save_pretrained: the 'pretrained' model the runs fine-tune."""
    torch.manual_seed(seed)
    tiny_gpt(dropout=dropout).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_base(tmp_path_factory.mktemp("base") / "gpt2")


def lora_args(base: Path, out: Path, *extra: str) -> list[str]:
    return [*DATA, "--model", str(base), *LORA, *STEPS, "--output_dir", str(out), *extra]


def base_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def adapter_of(output_dir: Path) -> dict[str, torch.Tensor]:
    """The final weights' adapter tensors, by their name in the base model's PeftModel."""
    return {k: v for k, v in load_weights(output_dir).items() if "lora_" in k}


def frozen_of(output_dir: Path) -> dict[str, torch.Tensor]:
    """The final weights' frozen base, named as in the base model."""
    from accel_ddp.transforms.finetune import base_name

    return {base_name(k): v for k, v in load_weights(output_dir).items() if "lora_" not in k}


# ----------------------------------------------------------------------------- the options


@pytest.mark.parametrize("options,expected", [
    (dict(peft="lora", lora_r=0), "--lora_r must be > 0, got 0"),
    (dict(peft="lora", lora_r=-2), "--lora_r must be > 0, got -2"),
    (dict(peft="qlora"), "--peft 'qlora' is unknown; choose one of lora"),
    (dict(lora_r=4), "--lora_r without --peft: nothing would use it"),
    (dict(merge_adapter=True, lora_dropout=0.1), "--lora_dropout, --merge_adapter without --peft"),
    (dict(peft="lora", lora_dropout=1.0), "--lora_dropout must be < 1"),
    (dict(peft="lora", lora_target_modules=" , "), "--lora_target_modules is empty"),
])
def test_bad_lora_options_are_one_line(options, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        TrainConfig(**options)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the guarantees


def test_one_process_and_two_ranks_with_accumulation_and_checkpointing_train_the_same_adapter(base, adapter_run,
                                                                                             tmp_path):
    """The same global batch: 1 process (8 x 1: the module's adapter run) and 2 ranks (2 x 2 accumulation,
    --gradient_checkpointing) end with the same adapters (atol 1e-6: float32 sums in another order), and the frozen
    base is the saved one, bit for bit. find_unused_parameters stays off (the default): DDP would raise if an adapter
    got no gradient. (The start-up line of the trainable parameters: the resume with the sampled fingerprint.)"""
    one, two = adapter_run, tmp_path / "two"
    summary = read_summary(one)
    train_ranks(lora_args(base, two, "--per_device_batch_size", "2", "--gradient_checkpointing"), world_size=2)
    assert read_summary(two)["grad_accum_steps"] == 2
    assert summary["trainable_parameters"] == TRAINABLE
    expected, got = adapter_of(one), adapter_of(two)
    assert len(expected) == 8 and expected.keys() == got.keys()
    for key in expected:
        assert torch.allclose(got[key], expected[key], atol=1e-6, rtol=0), key
    moved = [k for k in expected if "lora_B" in k and expected[k].abs().max() > 1e-3]  # B starts at zero
    assert len(moved) == 4, "the adapters did not train: nothing was compared"
    pretrained = base_weights(base)
    for out in (one, two):
        frozen = frozen_of(out)
        assert frozen.keys() - {"lm_head.weight"} == pretrained.keys() - {"lm_head.weight"}
        for key, tensor in pretrained.items():
            assert torch.equal(frozen[key], tensor), f"{out.name}: the frozen {key} changed"


def test_gradient_checkpointing_on_two_ranks_gives_the_weights_of_a_run_without_it(base, tmp_path):
    """Full fine-tuning of the Transformers model, 2 ranks, accumulation 2: with and without --gradient_checkpointing
    (non-reentrant: no "marked ready twice"), the same weights within 1e-6 (the recomputed forward is the same
    arithmetic; dropout 0.1 replays its masks from the saved RNG state)."""
    dropout_base = save_base(tmp_path / "dropout-base", dropout=0.1)
    args = [*DATA, "--model", str(dropout_base), *STEPS, "--per_device_batch_size", "2", "--optimizer", "sgd",
            "--lr", "0.5"]  # SGD: AdamW would turn float-rounding differences of near-zero gradients into lr-sized ones
    train_ranks([*args, "--output_dir", str(tmp_path / "plain")])
    train_ranks([*args, "--gradient_checkpointing", "--output_dir", str(tmp_path / "ckpt")])
    plain, ckpt = load_weights(tmp_path / "plain"), load_weights(tmp_path / "ckpt")
    for key in plain:
        assert torch.allclose(ckpt[key], plain[key], atol=1e-6, rtol=0), key
    start = base_weights(dropout_base)["transformer.h.0.attn.c_attn.weight"]
    assert not torch.allclose(plain["transformer.h.0.attn.c_attn.weight"], start, atol=1e-3)


def test_the_python_api_trains_adapters_on_the_callers_model_and_leaves_its_base_alone(tmp_path):
    """train(TrainConfig(peft="lora"), model=a Transformers model) on 2 ranks: the caller's base tensors are
    unchanged bit for bit (also with merge_adapter, which merges a copy), the adapter is exported."""
    def rank() -> bool:
        from accel_ddp.loop import train

        torch.manual_seed(0)
        model = tiny_gpt()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = TrainConfig(task="causal_lm", peft="lora", lora_r=2, merge_adapter=True, global_batch_size=8,
                          max_steps=4, lr=1e-2, num_workers=0, output_dir=str(tmp_path / "api"))
        train(cfg, model=model, train_dataset=Sequences(64), eval_dataset=Sequences(16, seed=1))
        from accel_ddp.transforms.finetune import base_name

        # peft injects the adapters into the caller's modules (their names gain .base_layer); the tensors stay
        after = {base_name(k): v for k, v in model.state_dict().items() if "lora_" not in k}
        return after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())

    assert run_ranks(rank, world_size=2) == [True, True]
    assert (tmp_path / "api" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "api" / "hf_model" / "model.safetensors").is_file()


def test_eval_perplexity_and_the_token_exact_loss_are_those_of_the_base_before_any_update(base, tmp_path):
    """A fresh adapter (B = 0) computes what the base does: the first step's loss (token-exact, before its update)
    is the full run's bit for bit, and the evaluation of a run whose one update is negligible (lr 1e-30) is the
    full run's: the same tokens, loss and perplexity."""
    args = [*DATA, "--model", str(base), "--global_batch_size", "8", "--max_steps", "1", "--lr", "1e-30"]
    [full] = train_ranks([*args, "--output_dir", str(tmp_path / "full")], world_size=1)
    [lora] = train_ranks([*args, *LORA, "--output_dir", str(tmp_path / "lora")], world_size=1)
    first = [[r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r][0] for name in ("full", "lora")]
    assert first[0] == first[1]
    assert lora["eval_tokens"] == full["eval_tokens"] > 0
    for key in ("eval_loss", "eval_perplexity"):
        assert lora[key] == pytest.approx(full[key], rel=1e-6), key


# ----------------------------------------------------------------------------- checkpoints and resume


@pytest.fixture(scope="module")
def adapter_run(base, tmp_path_factory) -> Path:
    """A LoRA run of 8 steps on one process, checkpointing every 4 (saving changes no bit of the training). Tests
    only read it."""
    out = tmp_path_factory.mktemp("adapter-run") / "run"
    train_ranks(lora_args(base, out, "--checkpointing_steps", "4"), world_size=1)
    return out


@pytest.fixture(scope="module")
def adapter_checkpoint(adapter_run) -> Path:
    """The adapter run's checkpoint at step 4 (of 8: the resumes below have steps left)."""
    return adapter_run / "checkpoints" / "step_00000004"


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_state_and_the_base_fingerprint(adapter_checkpoint):
    folder = adapter_checkpoint
    out = folder.parent.parent
    weights = load_file(str(folder / "model.safetensors"))
    assert len(weights) == 8 and all("lora_" in k for k in weights)
    assert sum(t.numel() for t in weights.values()) == TRAINABLE
    optimizer = torch.load(folder / "optimizer.bin", weights_only=True)
    assert len(optimizer["state"]) == 8  # AdamW moments for the adapters only
    meta = json.loads((folder / "checkpoint.json").read_text())
    assert meta["base_fingerprint"] == read_summary(out)["base_fingerprint"]
    assert (folder / "model.safetensors").stat().st_size * 10 < (out / "model.safetensors").stat().st_size


def test_async_saves_and_the_best_checkpoint_hold_and_load_the_trainable_state(base, tmp_path):
    """--async_checkpointing's snapshot saves what the synchronous save does; --load_best_model_at_end loads an
    adapter checkpoint back (its frozen base left out) into the final weights. One run shows both: the best is loaded
    from the files the snapshots wrote."""
    out = tmp_path / "run"
    [summary] = train_ranks(lora_args(base, out, "--checkpointing_steps", "2", "--async_checkpointing",
                                      "--eval_every", "2", "--load_best_model_at_end"), world_size=1)
    assert steps_of(out) == [2, 4, 6, 8]
    for step in steps_of(out):
        weights = load_file(str(out / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))
        assert len(weights) == 8 and all("lora_" in k for k in weights)
    best = load_file(str(out / "checkpoints" / f"step_{summary['best_step']:08d}" / "model.safetensors"))
    final = load_weights(out)
    assert all(torch.equal(final[k], v) for k, v in best.items())


def test_lora_on_a_model_from_a_config_and_ddp_without_find_unused_parameters(tmp_path):
    """--model_config builds the base with fresh weights; DDP wraps it with find_unused_parameters off and only the
    adapters to reduce."""
    config = tmp_path / "gpt2.json"
    tiny_gpt().config.to_json_file(str(config))
    args = [*DATA, "--model_config", str(config), *LORA, *STEPS, "--output_dir", str(tmp_path / "run")]

    def rank() -> tuple:
        from contextlib import ExitStack

        from accel_ddp.assemble import setup
        from accel_ddp.cli.args import parse_args

        with ExitStack() as teardown:
            ddp = setup(parse_args(args), teardown).model
            reduced = sum(p.numel() for p in ddp.module.parameters() if p.requires_grad)
            return type(ddp).__name__, ddp.find_unused_parameters, reduced

    assert run_ranks(rank, world_size=2) == [("DistributedDataParallel", False, TRAINABLE)] * 2


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> tuple[Path, list[str]]:
    """The uninterrupted adapter run on 2 ranks, with dropout in the base and the adapters (RNG state matters),
    checkpointing every 2 steps."""
    dropout_base = save_base(tmp_path_factory.mktemp("dropout") / "gpt2", dropout=0.1)
    out = tmp_path_factory.mktemp("reference") / "run"
    extra = ["--lora_dropout", "0.1", "--checkpointing_steps", "2", "--gradient_checkpointing"]
    args = [*DATA, "--model", str(dropout_base), *LORA, *STEPS, *extra]
    assert main_ranks([*args, "--output_dir", str(out)]) == [0, 0]
    return out, args


def test_sigterm_then_kill_9_each_resumed_give_the_uninterrupted_adapter_bit_for_bit(reference, tmp_path):
    """One run stopped twice, each stop resumed: SIGTERM to rank 1 after step 3 (every rank saves step 3 and exits 75),
    then in the resumed run rank 1 SIGKILLed right after step 5 (as the out-of-memory killer does: the resume's
    checkpoint of step 4 is the last), resumed again: the uninterrupted run's weights bit for bit, which each resume
    must give for the next to start from them."""
    ref, args = reference
    out = tmp_path / "run"

    def signalled() -> int:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        import accel_ddp.lifecycle.preemption as preemption
        from accel_ddp.cli.train import main

        preemption.CHECK_EVERY_SECONDS = 0  # flags compared after every step: the stop follows the signal's step
        steps = [0]

        def after_step(*_):
            steps[0] += 1
            if steps[0] == 3 and os.environ.get("RANK") == "1":
                os.kill(os.getpid(), signal.SIGTERM)

        register_optimizer_step_post_hook(after_step)
        return main([*args, "--output_dir", str(out)])

    assert run_ranks(signalled, world_size=2) == [75, 75]
    assert steps_of(out)[-1] == 3 and not (out / "summary.json").exists()

    def killed() -> int:
        from accel_ddp.cli.train import main

        faults.install(kill_at=(5, 1))  # the step as the restored schedule counts it: 2 steps after the resume
        return main([*args, "--output_dir", str(out), "--resume_from_checkpoint", "auto"])

    with pytest.raises(RankFailed, match="exited with code -9"):
        run_ranks(killed, world_size=2)
    assert steps_of(out)[-1] == 4 and not (out / "summary.json").exists()
    assert main_ranks([*args, "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) == [0, 0]
    assert read_summary(out)["resumed_from_step"] == 4
    assert_same_weights(out, ref)


# ----------------------------------------------------------------------------- bad input: one line, exit 2


def assert_refused(codes: list[int], capfd, expected: str) -> str:
    err = capfd.readouterr().err
    assert codes == [2] * len(codes), err[-2000:]
    lines = [line for line in err.splitlines() if "accel_ddp: error:" in line]
    assert lines and expected in lines[0], err[-2000:]
    assert "Traceback" not in err
    return err


def assert_refused_once(codes: list[int], capfd, expected: str) -> str:
    """assert_refused, and the line printed once for the launch, whatever its ranks."""
    err = assert_refused(codes, capfd, expected)
    assert err.count("accel_ddp: error:") == 1, err[-2000:]
    return err


def test_a_target_module_that_does_not_exist_is_one_line(base, tmp_path, capfd):
    capfd.readouterr()
    codes = main_ranks([*lora_args(base, tmp_path / "run"), "--lora_target_modules", "c_attn,q_proj"], 1)
    assert_refused(codes, capfd, "--lora_target_modules: q_proj names no linear layer of GPT2LMHeadModel; its "
                   "linear layers are c_attn, c_fc, c_proj")


def test_lora_r_zero_is_one_line(base, tmp_path, capfd):
    capfd.readouterr()
    assert_refused(main_ranks([*lora_args(base, tmp_path / "run"), "--lora_r", "0"], 1), capfd,
                   "--lora_r must be > 0, got 0")


def test_an_adapter_checkpoint_for_another_base_is_one_line(adapter_checkpoint, tmp_path, capfd):
    other = save_base(tmp_path / "other", seed=1)  # the same architecture, other weights
    capfd.readouterr()
    codes = main_ranks(lora_args(other, tmp_path / "second", "--resume_from_checkpoint", str(adapter_checkpoint)), 1)
    assert_refused(codes, capfd, "its adapter belongs to another base model")


def test_a_full_checkpoint_resumed_with_peft_is_one_line(base, tmp_path, capfd):
    out = tmp_path / "run"
    train_ranks([*DATA, "--model", str(base), *STEPS, "--checkpointing_steps", "4", "--max_steps", "4",
                 "--output_dir", str(out)], world_size=1)
    capfd.readouterr()
    codes = main_ranks(lora_args(base, tmp_path / "again", "--resume_from_checkpoint",
                                 str(out / "checkpoints" / "step_00000004")), 1)
    assert_refused(codes, capfd, "it holds a model trained in full, this run freezes a base")


def changed_base(base: Path, folder: Path) -> Path:
    """A copy of ``base`` with one weight moved by 0.5: h.1.mlp.c_fc.weight[3, 5] (not among a strided sample's)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(base, folder)
    weights = base_weights(folder)
    weights["transformer.h.1.mlp.c_fc.weight"][3, 5] += 0.5
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_an_adapter_checkpoint_on_a_base_with_one_changed_weight_is_one_line(base, adapter_checkpoint, tmp_path,
                                                                            capfd):
    """The base's fingerprint covers every value of its weights: one weight moved by 0.5 is another base."""
    other = changed_base(base, tmp_path / "changed")
    capfd.readouterr()
    codes = main_ranks(lora_args(other, tmp_path / "second", "--resume_from_checkpoint", str(adapter_checkpoint)), 2)
    assert_refused_once(codes, capfd, "its adapter belongs to another base model")
    assert json.loads((adapter_checkpoint / "checkpoint.json").read_text())["base_fingerprint"].startswith("sha256:")


def test_a_checkpoint_with_the_earlier_sampled_fingerprint_resumes_with_a_warning_and_still_refuses_another_base(
        base, adapter_checkpoint, tmp_path, capfd):
    """A checkpoint of an earlier version holds the fingerprint of 64 sampled values per tensor: it resumes on its base
    with one warning that the check is weaker (the run's new checkpoints hold the full one); a base of other
    weights is still refused."""
    import shutil

    from transformers import AutoModelForCausalLM

    from accel_ddp.transforms.finetune import add_lora, sampled_fingerprint

    old = tmp_path / "old" / "step_00000004"
    shutil.copytree(adapter_checkpoint, old)
    meta = json.loads((old / "checkpoint.json").read_text())
    tuned = add_lora(AutoModelForCausalLM.from_pretrained(str(base)), 4, 8.0, 0.0, "c_attn,c_fc")
    meta["base_fingerprint"] = sampled_fingerprint(tuned)
    meta.pop("lora_r", None)
    (old / "checkpoint.json").write_text(json.dumps(meta))
    capfd.readouterr()
    train_ranks(lora_args(base, tmp_path / "resumed", "--resume_from_checkpoint", str(old)), world_size=2)
    said = capfd.readouterr()
    warned = [line for line in said.err.splitlines() if "sampled fingerprint" in line]
    assert len(warned) == 1 and "a few changed weights would not show" in warned[0], warned
    summary = read_summary(tmp_path / "resumed")
    assert summary["base_fingerprint"].startswith("sha256:")
    assert f"{TRAINABLE:,} trainable of {summary['total_parameters']:,} parameters" in said.out  # the start-up line
    codes = main_ranks(lora_args(save_base(tmp_path / "other", seed=1), tmp_path / "third",
                                 "--resume_from_checkpoint", str(old)), 1)
    assert_refused(codes, capfd, "its adapter belongs to another base model")


def test_resuming_with_another_lora_r_names_lora_r(base, adapter_checkpoint, tmp_path, capfd):
    capfd.readouterr()
    codes = main_ranks([*lora_args(base, tmp_path / "again", "--resume_from_checkpoint", str(adapter_checkpoint)),
                        "--lora_r", "8"], 2)
    err = assert_refused_once(codes, capfd, f"--resume_from_checkpoint {adapter_checkpoint}: its adapters have rank "
                              "--lora_r 4, this run has --lora_r 8; resume with --lora_r 4")
    assert "shape mismatch" not in err


def test_adapter_weights_of_another_rank_name_lora_r_also_where_checkpoint_json_does_not(tmp_path):
    """A checkpoint of an earlier version records no lora_r: the load itself names it, not the shapes."""
    from safetensors.torch import save_file

    from accel_ddp.checkpoint.weights import load_weights as load_into
    from accel_ddp.checkpoint.weights import trainable_state_dict
    from accel_ddp.transforms.finetune import add_lora

    torch.manual_seed(0)
    save_file(trainable_state_dict(add_lora(tiny_gpt(), 4, 8.0, 0.0, "c_attn")), str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="its adapters have rank --lora_r 4, this run has --lora_r 8; use --lora_r 4"):
        load_into(add_lora(tiny_gpt(), 8, 8.0, 0.0, "c_attn"), str(tmp_path / "model.safetensors"),
                  source="--resume_from_checkpoint", keep_frozen=True)


def test_init_from_a_lora_runs_weights_says_where_the_merged_model_is(base, adapter_checkpoint, tmp_path, capfd):
    """A LoRA run's model.safetensors is the same model under peft's names (base_model.model..., lora_A/B):
    --init_from it is told to point at the merged hf_model/ (or the adapter/), not to change --model."""
    run = adapter_checkpoint.parent.parent
    capfd.readouterr()
    codes = main_ranks([*DATA, "--model", str(base), *STEPS, "--output_dir", str(tmp_path / "next"),
                        "--init_from", str(run / "model.safetensors")], 2)
    err = assert_refused_once(codes, capfd, f"--init_from {run / 'model.safetensors'} holds a LoRA run's model (the "
                              "same model under peft's names, its adapters not merged): point --init_from to "
                              "RUN/hf_model/model.safetensors")
    assert "different model" not in err


@pytest.mark.parametrize("extra,expected", [
    (["--peft", "lora"], "--peft lora: Sequential is not a Transformers model"),
    (["--gradient_checkpointing"], "--gradient_checkpointing: Sequential is not a Transformers model"),
])
def test_options_for_transformers_models_on_another_model_are_one_line(extra, expected, tmp_path, capfd):
    capfd.readouterr()
    codes = main_ranks(["--dataset", "synthetic", "--synthetic_samples", "64", "--max_steps", "1",
                        "--output_dir", str(tmp_path / "run"), *extra], 1)
    assert_refused(codes, capfd, expected)


def test_without_peft_installed_the_line_names_the_extra(base, tmp_path, capfd):
    def rank() -> int:
        from accel_ddp.cli.train import main

        sys.modules["peft"] = None  # import peft raises ImportError, as where it is not installed
        return main(lora_args(base, tmp_path / "run"))

    capfd.readouterr()
    assert_refused(run_ranks(rank, world_size=1), capfd,
                   "--peft lora needs the peft package, which is not installed; pip install 'accel_ddp[finetune]'")


# ----------------------------------------------------------------------------- the exports


def test_the_adapter_loads_with_peft_and_the_merged_model_without_it_with_the_same_logits_tied_output_layer_too(
        base, tmp_path, capfd):
    """adapter/ on the base through PeftModel.from_pretrained and hf_model/ through Transformers alone give the
    same logits (atol 1e-5), which differ from the base's: the adapter trained and nothing dropped it. The adapters
    include GPT-2's lm_head, tied to the input embedding wte, where an adapter changes the output layer only: the
    merged hf_model/ holds an output layer of its own (wte is the base's, bit for bit) and gives base + adapter's
    logits; a note at start says so, once. (One run shows both: the untied lm_head is merged beside c_attn and c_fc.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    capfd.readouterr()
    train_ranks(lora_args(base, out, "--lora_target_modules", "lm_head,c_attn,c_fc", "--merge_adapter"), world_size=2)
    notes = [line for line in capfd.readouterr().err.splitlines() if "untied" in line]
    assert len(notes) == 1 and "lm_head is tied to transformer.wte" in notes[0], notes
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert adapter and not any(k.startswith("module.") for k in adapter)
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
    tokens = torch.randint(2, 48, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(str(base)).eval()
        base_logits = plain(tokens).logits
        adapter_logits = PeftModel.from_pretrained(plain, str(out / "adapter")).eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(str(out / "hf_model")).eval()
        merged_logits = merged(tokens).logits
    assert "lora" not in " ".join(k for k, _ in merged.named_parameters())
    assert not torch.allclose(adapter_logits, base_logits, atol=1e-3), "the adapters did not train"
    off = (merged_logits - adapter_logits).abs().max()
    assert torch.allclose(merged_logits, adapter_logits, atol=1e-5, rtol=0), off
    assert torch.equal(merged.transformer.wte.weight, base_weights(base)["transformer.wte.weight"])
    assert merged.lm_head.weight.data_ptr() != merged.transformer.wte.weight.data_ptr()
    assert not merged.config.tie_word_embeddings


def test_a_merge_that_does_not_give_the_adapters_logits_is_refused_before_hf_model_is_written(base, tmp_path, capfd,
                                                                                              monkeypatch):
    """Every merged export is checked against the adapter model's logits on a few tokens before it is renamed into
    place: a merge that changes them (here peft's merge made to add twice the update) is one line, exit 2, and no
    hf_model/ (the adapter/ is written)."""
    from peft.tuners.lora import Linear as LoraLinear

    from accel_ddp.transforms.finetune import MERGE_CHECK_TOKENS  # noqa: F401 - the check exists

    merge = LoraLinear.merge

    def merge_twice(self, *args, **kwargs):
        merge(self, *args, **kwargs)
        self.merged_adapters.clear()
        merge(self, *args, **kwargs)

    monkeypatch.setattr(LoraLinear, "merge", merge_twice)  # forked ranks inherit it
    capfd.readouterr()
    codes = main_ranks(lora_args(base, tmp_path / "run", "--merge_adapter"), 2)
    assert_refused_once(codes, capfd, "--merge_adapter: the merged model's logits differ from the adapter model's")
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "run" / "hf_model").exists()


def test_peft_under_fsdp_is_refused_before_anything_is_built():
    from functools import partial
    from types import SimpleNamespace

    from accel_ddp.config.views import section_of
    from accel_ddp.transforms.finetune import PEFT
    from accel_ddp.util.converters import ModelBuild, convert_model

    read = partial(section_of, TrainConfig(peft="lora", task="causal_lm"))
    with pytest.raises(ConfigError, match="--peft lora under FSDP is not supported yet; launch with a DDP config"):
        convert_model(tiny_gpt(), ModelBuild(SimpleNamespace(is_fsdp2=True), None), (PEFT,), read)


def test_the_fingerprint_is_the_bases_whatever_the_adapters_and_changes_with_its_weights():
    from accel_ddp.transforms.finetune import add_lora, base_fingerprint

    torch.manual_seed(0)
    plain = tiny_gpt().requires_grad_(False)
    fingerprint = base_fingerprint(plain)
    for targets in ("c_attn", "all-linear"):
        torch.manual_seed(0)
        assert base_fingerprint(add_lora(tiny_gpt(), 2, 4.0, 0.0, targets)) == fingerprint
    with torch.no_grad():
        plain.transformer.h[1].mlp.c_fc.weight[3, 5] += 0.5  # not among a strided sample's values
    assert base_fingerprint(plain) != fingerprint
    assert base_fingerprint(tiny_gpt()) is None  # nothing frozen
