"""``OUTPUT_DIR/README.md``: the run's model card, as Hugging Face model folders have one.

Model, data, world size and batch layout, final metrics, the command that launched the run and a
link to ``curves.png``, with the YAML header the Hub reads (library, tags, datasets, metrics).
Written at the end of training by the main process; ``config.yaml`` keeps every resolved option.

    write_model_card("outputs/run", cfg.to_dict(), summary, launch_command(sys.argv, os.environ))
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from typing import Any

from accel_ddp.lifecycle.exit_codes import EXIT_CODES_DIR
from accel_ddp.outputs.metrics_file import read_metrics
from accel_ddp.outputs.names import (
    CONFIG_NAME,
    CURVES_NAME,
    METRICS_NAME,
    MODEL_CARD_NAME,
    PRETRAINED_SUBDIR,
    SUMMARY_NAME,
    WEIGHTS_NAME,
)
from accel_ddp.util import yaml_text
from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.messages import warn
from accel_ddp.util.ranks import launch_machines, launch_world_size, local_world_size

# (summary.json key, label): the final figures the card shows, in this order, when present
RESULTS = (
    ("eval_accuracy", "eval accuracy"),
    ("eval_loss", "eval loss"),
    ("eval_perplexity", "eval perplexity"),
    ("eval_samples", "eval samples"),
    ("train_samples_per_sec", "training samples/s"),
    ("train_seconds", "training time (s)"),
    ("elapsed_sec", "wall time (s)"),
)


def launch_command(argv: list[str], env: Mapping[str, str]) -> str:
    """The command line that started this process, rebuilt from ``sys.argv`` and the launcher's environment.

    ``accelerate launch`` passes no record of its config file, so its settings come back as the
    equivalent flags (processes, machines, mixed precision, dynamo backend):

        >>> launch_command(["train.py", "--epochs", "2"], {"ACCELERATE_MIXED_PRECISION": "no", "WORLD_SIZE": "2"})
        'accelerate launch --multi_gpu --num_processes 2 --mixed_precision no train.py --epochs 2'
    """
    program = argv[0] if argv else "train.py"
    if program.endswith(os.path.join("accel_ddp", "__main__.py")):
        target = ["-m", "accel_ddp"]  # python -m accel_ddp / accelerate launch -m accel_ddp
    else:
        target = [program]
    args = list(argv[1:])
    world, machines = launch_world_size(env), launch_machines(env)
    if "ACCELERATE_MIXED_PRECISION" in env:  # set by every accelerate launch
        launcher = ["accel-ddp" if env.get(EXIT_CODES_DIR) else "accelerate", "launch"]  # accel-ddp launch sets it
        if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
            launcher.append("--use_fsdp")
        elif world > 1:
            launcher.append("--multi_gpu")  # torchrun underneath; accel_ddp picks CPU itself when there is no GPU
        launcher += ["--num_processes", str(world)]
        if machines > 1:
            launcher += ["--num_machines", str(machines), "--machine_rank", "MACHINE_RANK",
                         "--main_process_ip", env.get("MASTER_ADDR", "MAIN_IP"),
                         "--main_process_port", env.get("MASTER_PORT", "29500")]
        launcher += ["--mixed_precision", env["ACCELERATE_MIXED_PRECISION"]]
        backend = env.get("ACCELERATE_DYNAMO_BACKEND", "NO")
        if backend.upper() != "NO":
            launcher += ["--dynamo_backend", backend.lower()]
    elif "TORCHELASTIC_RUN_ID" in env:  # torchrun
        launcher = ["torchrun", "--nnodes", str(machines), "--nproc_per_node", str(local_world_size(world, env))]
    elif os.path.basename(program) == "accel-ddp":  # the console script runs as is
        return shlex.join(["accel-ddp", *args])
    else:
        launcher = ["python"]
    return shlex.join([*launcher, *target, *args])


def render_model_card(config: dict[str, Any], summary: dict[str, Any], command: str, output_dir: str) -> str:
    """The card's Markdown, from the resolved config, the final summary and the launch command."""
    name = os.path.basename(os.path.abspath(output_dir))
    header: dict[str, Any] = {"library_name": "accel_ddp", "tags": ["accel_ddp"]}
    if config.get("dataset") == "hf" and config.get("hf_name"):
        header["datasets"] = [config["hf_name"]]  # a Hub dataset id
    metrics = [name for name in ("accuracy", "perplexity") if summary.get(f"eval_{name}") is not None]
    if metrics:
        header["metrics"] = metrics
    world, machines = summary.get("world_size", 1), summary.get("num_machines", 1)
    lines = [
        "---", yaml_text.dump(header).strip(), "---", "",
        f"# {name}", "",
        f"`{config.get('model_config') or config.get('model')}` trained on {_data(config)} with accel_ddp "
        "(data-parallel PyTorch through Hugging Face Accelerate).", "",
        "## Training", "",
        "| | |", "| --- | --- |",
        f"| model | {_model(config)} |",
        f"| data | {_data(config)} |",
        f"| world size | {world} rank{'s' if world != 1 else ''} on {machines} machine{'s' if machines != 1 else ''} "
        f"({summary.get('distributed_type')}, {summary.get('device')}) |",
        f"| global batch | {summary.get('global_batch_size')} samples = {world} x "
        f"{summary.get('per_device_batch_size')} per device x {summary.get('grad_accum_steps')} accumulation steps |",
        f"| optimizer | {config.get('optimizer')}, lr {config.get('lr')}, {config.get('lr_schedule')} schedule, "
        f"{config.get('warmup_steps')} warmup steps, weight decay {config.get('weight_decay')}, "
        f"gradient clipping {config.get('max_grad_norm')} |",
        f"| steps | {summary.get('optimizer_steps')} optimizer steps, {summary.get('epochs')} epochs"
        + (f", resumed from step {summary['resumed_from_step']}" if summary.get("resumed_from_step") else "") + " |",
        f"| mixed precision | {summary.get('mixed_precision')} |",
        f"| seed | {config.get('seed')} |",
        "", "## Results", "", "| metric | value |", "| --- | --- |",
    ]
    loss = _last_loss(output_dir)
    if loss is not None:
        lines.append(f"| final training loss | {_number(loss)} |")
    lines += [f"| {label} | {_number(summary[key])} |" for key, label in RESULTS if summary.get(key) is not None]
    if os.path.isfile(os.path.join(output_dir, CURVES_NAME)):
        lines += ["", f"![Training loss, eval accuracy, learning rate and throughput against step]({CURVES_NAME})"]
    lines += [
        "", "## Launch command", "",
        "```bash", command, "```", "",
        "Rebuilt from the process's arguments and the launcher's environment (a launch config file shows up as "
        f"its flags). Every resolved option is in [`{CONFIG_NAME}`]({CONFIG_NAME}).", "",
        "## Files", "",
        f"- [`{WEIGHTS_NAME}`]({WEIGHTS_NAME}): the final weights of the unwrapped model (safetensors)",
        f"- [`{CONFIG_NAME}`]({CONFIG_NAME}), [`{METRICS_NAME}`]({METRICS_NAME}), [`{SUMMARY_NAME}`]({SUMMARY_NAME}): "
        "the resolved config, every logged step and evaluation, the final figures",
    ]
    if os.path.isdir(os.path.join(output_dir, PRETRAINED_SUBDIR)):
        lines.append(f"- [`{PRETRAINED_SUBDIR}/`]({PRETRAINED_SUBDIR}): the Transformers model (save_pretrained) "
                     "and its tokenizer")
    return "\n".join(lines) + "\n"


def write_model_card(output_dir: str, config: dict[str, Any], summary: dict[str, Any], command: str) -> str | None:
    """Write ``OUTPUT_DIR/README.md`` (call on the main process). A failure warns: the run's files stay valid."""
    path = os.path.join(output_dir, MODEL_CARD_NAME)
    try:
        text = render_model_card(config, summary, command, output_dir)
        atomic_write_text(path, text)
    except OSError as err:
        warn(f"could not write {path}: {err}", ranks="first")
        return None
    return path


def _model(config: dict[str, Any]) -> str:
    sizes = {"mlp": f"hidden size {config.get('hidden_size')}", "resnet18": f"width {config.get('width')}"}
    size = sizes.get(config.get("model", ""))
    started = f", fine-tuned from `{config['init_from']}`" if config.get("init_from") else ""
    if config.get("model_config"):  # a Transformers model built from a config file
        return f"`{config['model_config']}` (fresh weights, --task {config.get('task')})" + started
    return f"`{config.get('model')}`" + (f" ({size})" if size else "") + started


def _data(config: dict[str, Any]) -> str:
    dataset = config.get("dataset")
    if dataset == "hf":
        source = config.get("hf_name") or config.get("data_dir")
        return f"`{source}` (Hugging Face datasets, split {config.get('hf_train_split')})"
    if dataset == "synthetic":
        return f"`synthetic` ({config.get('synthetic_samples')} samples of shape {config.get('synthetic_shape')})"
    return f"`{dataset}`"


def _last_loss(output_dir: str) -> float | None:
    try:
        losses = [r["loss"] for r in read_metrics(output_dir) if isinstance(r.get("loss"), (int, float))]
    except FileNotFoundError:
        return None
    return losses[-1] if losses else None


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
