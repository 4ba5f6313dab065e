"""accel_ddp/assemble.py: ``setup()`` builds a run from the config on every rank: the batch layout and the plan,
the optimizer over the prepared model, the schedule over the run's own total, the output folder, where it starts."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack

import pytest
import yaml

from accel_ddp.cli.args import parse_args
from tests.helpers.multiproc import run_ranks

ARGS = ["--dataset", "synthetic", "--synthetic_samples", "100", "--synthetic_shape", "6", "--model", "mlp",
        "--hidden_size", "8", "--global_batch_size", "16", "--per_device_batch_size", "4", "--epochs", "2",
        "--lr", "0.2", "--warmup_ratio", "0.25", "--lr_schedule", "linear"]


def _set_up(output_dir: str) -> dict:
    from accel_ddp.assemble import setup

    with ExitStack() as teardown:
        run = setup(parse_args([*ARGS, "--output_dir", output_dir]), teardown)
        trained = {id(p) for p in run.model.parameters()}
        in_optimizer = [p for group in run.optimizer.param_groups for p in group["params"]]
        return {
            "layout": (run.plan.per_device_batch, run.plan.accumulation, run.plan.steps_per_epoch,
                       run.plan.total_steps, run.plan.num_epochs),
            "lrs": [group["lr"] for group in run.optimizer.param_groups],
            "optimizer_holds_the_prepared_model": {id(p) for p in in_optimizer} == trained
            and len(in_optimizer) == len(trained),
            "world": (run.accelerator.num_processes, run.facts["world_size"]),
            "start_step": run.start_step,
        }


@pytest.mark.parametrize("world", [1, 2])
def test_setup_derives_the_layout_plan_and_schedule_from_the_config(tmp_path, world):
    """100 samples, global batch 16 of 4-sample micro-batches: 6 optimizer steps an epoch (the partial batch
    dropped), 12 in 2 epochs, 8 / world micro-steps each; --warmup_ratio 0.25 of 12 is 3 warmup steps, so the first
    step's LR is 0.2 x 1/4 in both parameter groups; every rank agrees, and the run starts at step 0."""
    out = tmp_path / "run"
    built = run_ranks(lambda: _set_up(str(out)), world_size=world)
    assert all(rank == built[0] for rank in built)
    assert built[0]["layout"] == (4, 4 // world, 6, 12, 2)
    assert built[0]["lrs"] == [pytest.approx(0.05)] * 2
    assert built[0]["optimizer_holds_the_prepared_model"] and built[0]["world"] == (world, world)
    assert built[0]["start_step"] == 0
    written = yaml.safe_load((out / "config.yaml").read_text())  # the resolved config, before the first step
    assert (written["global_batch_size"], written["per_device_batch_size"], written["warmup_ratio"]) == (16, 4, 0.25)


def test_the_model_converters_run_in_one_order_the_training_only_ones_last():
    """assemble.MODEL_CONVERTERS: the order the transforms were applied in before they were a list (issue 52)."""
    from accel_ddp.assemble import MODEL_CONVERTERS

    assert [c.name for c in MODEL_CONVERTERS] == ["init_from", "gradient_checkpointing", "peft", "channels_last",
                                                  "fused_kernels", "compile_regions", "chunked_loss"]
    training_only = [c.training_only for c in MODEL_CONVERTERS]
    assert training_only == sorted(training_only)  # inference.py's rebuilt model stops before the first of them


def test_each_model_converter_reads_a_declared_section_of_the_options():
    """A converter is given its own typed section (config/views.py), never the whole config (issue 52 item 2)."""
    from accel_ddp.assemble import MODEL_CONVERTERS
    from accel_ddp.config import TrainConfig
    from accel_ddp.config.views import SECTIONS, section_of
    from accel_ddp.util.converters import NoOptions

    for converter in MODEL_CONVERTERS:
        assert converter.options in SECTIONS or converter.options is NoOptions, converter.name
        assert isinstance(section_of(TrainConfig(), converter.options), converter.options)
    # the option that switches a converter on is one of its section's fields (channels_last: the task's layout)
    assert all(c.name in {f.name for f in dataclasses.fields(c.options)} for c in MODEL_CONVERTERS
               if c.options is not NoOptions)


def test_a_model_through_several_converters_equals_the_transforms_applied_by_hand(tmp_path):
    """--init_from, --gradient_checkpointing, --peft lora, --fused_kernels, --compile_regions and --chunked_loss
    through setup's model stage: the same modules, weights, trainable set and start-up description as the
    transforms called one by one in the order setup called them before the list."""
    pytest.importorskip("peft")
    import torch
    from accelerate import Accelerator
    from safetensors.torch import save_file

    from accel_ddp.assemble import _model, configured_task
    from accel_ddp.checkpoint.weights import load_weights
    from accel_ddp.tasks.chunked_loss import split_output_layer
    from accel_ddp.transforms.finetune import add_lora, enable_activation_checkpointing
    from accel_ddp.transforms.fused_activations import fuse_activations
    from accel_ddp.transforms.regional_compile import compile_regions
    from tests.helpers.text import tiny_gpt

    torch.manual_seed(1)
    save_file({k: v.contiguous() for k, v in tiny_gpt().state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "init.safetensors"))
    cfg = parse_args(["--task", "causal_lm", "--init_from", str(tmp_path / "init.safetensors"),
                      "--gradient_checkpointing", "--peft", "lora", "--lora_target_modules", "c_attn",
                      "--fused_kernels", "--compile_regions", "--chunked_loss", "--output_dir", str(tmp_path / "o")])
    task = configured_task(cfg)
    torch.manual_seed(0)
    converted, named, _ = _model(cfg, Accelerator(cpu=True), tiny_gpt(), None, task)

    torch.manual_seed(0)
    by_hand = tiny_gpt()
    load_weights(by_hand, cfg.init_from)
    enable_activation_checkpointing(by_hand)
    by_hand = add_lora(by_hand, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    fused, regions = fuse_activations(by_hand), compile_regions(by_hand)
    split_output_layer(by_hand)

    assert [(n, type(m).__name__) for n, m in converted.named_modules()] == \
        [(n, type(m).__name__) for n, m in by_hand.named_modules()]
    assert {n: p.requires_grad for n, p in converted.named_parameters()} == \
        {n: p.requires_grad for n, p in by_hand.named_parameters()}
    pairs = zip(converted.state_dict().values(), by_hand.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert named.endswith(f", {fused} tanh-GELU modules on torch's one kernel (--fused_kernels), {regions} repeated "
                          "blocks compiled (--compile_regions), output layer chunked into the loss (--chunked_loss)")
    assert task.split_head is not None and fused > 0 and regions > 0
