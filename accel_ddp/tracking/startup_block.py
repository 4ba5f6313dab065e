"""What a run is about to do, said once before its first step: the start-up block.

The main process prints it (stdout; its warnings also as ``accel_ddp: warning:`` lines on stderr),
appends it to ``OUTPUT_DIR/run.log`` and writes it into ``config.yaml``'s ``startup:`` section, which
``--config`` ignores on replay (config/saved.py ``REPLAYED_KEYS``: derived facts never become flags).

    block = StartupBlock.describe(section_of(cfg, StartupOptions), facts, epochs=2, workers=0, warmup=0,
                                  global_batch_derived=False, model="MLP, 2,410 parameters")
    block.start = resumed_from(120, "outputs/run/checkpoints/step_00000120")
    print(block.text())                      # the aligned `key: value` lines below a header
    block.as_dict()                          # config.yaml's startup: section

Plain values only (no torch): the loop gathers them, this module says them and spots likely mistakes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from accel_ddp.config.debug import debug_mode
from accel_ddp.config.views import config_section
from accel_ddp.util.cpu_bf16 import cpu_bf16_verdict, cpu_has_bf16_units, read_cpuinfo
from accel_ddp.util.messages import warn, write
from accel_ddp.util.ranks import local_world_size

HEADER = "accel_ddp: ***** Running training *****"
SOURCES = {"in_memory": "data in memory", "memory_mapped": "memory-mapped (read per batch)",
           "streaming": "streamed", "map_style": "a map-style dataset (read per sample)"}


@config_section
@dataclass(frozen=True)
class StartupOptions:
    """The options the block says (the layout comes from the run's facts)."""

    task: str
    mixed_precision: str | None  # given or not: where the precision came from
    debug: bool
    max_steps: int | None  # with epochs and global_batch_size: the steps --debug cut
    epochs: int
    global_batch_size: int | None
    optimizer: str
    optimizer_kwargs: str | None
    weight_decay: float
    max_grad_norm: float
    lr: float
    lr_schedule: str
    seed: int
    output_dir: str
    checkpoint_dir: str | None
    checkpointing_steps: str | None
    keep_last: int
    with_tracking: bool
    report_to: str | None
    max_length: int  # a token task's tokens per step
    packing: bool


@dataclass
class StartupBlock:
    """The block's lines (label -> text, in order) and the warnings about what looks like a mistake."""

    lines: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    start: str = "fresh"  # or resumed_from(...)

    @classmethod
    def describe(cls, options: StartupOptions, facts: dict[str, Any], *, epochs: int, workers: int | None,
                 model: str, warmup: int, global_batch_derived: bool, data_sizes: tuple[tuple[int, int], ...] = (),
                 cpus: int = 1, env=os.environ, examples: tuple[int | None, int | None] = (None, None),
                 optimization: dict[str, str] | None = None, counts_tokens: bool = False) -> StartupBlock:
        """From the options, the run's facts (assemble._run_facts), and what only the loop knows.

        ``warmup``: the warmup in optimizer steps (the config's ``warmup_for``); ``global_batch_derived``: the
        global batch was made by a per-device batch (the Trainer's meaning); ``workers``: the training loader's
        DataLoader workers per rank (None: no DataLoader); ``data_sizes``: --debug's (kept, full) sample counts of the
        training and eval sets; ``cpus``: the cores this rank may use; ``examples``: the samples of the training and
        eval sets as trained (None: a stream's, unknown; no eval set); ``optimization``: the optimizer lines the flags
        alone cannot write (optim_user.Optimization.lines); ``counts_tokens``: the task's (``Task.counts_tokens``):
        the tokens of a step get their line.
        """
        world, machines = facts["world_size"], facts["num_machines"]
        per_device, accumulation, global_batch = (facts["per_device_batch_size"], facts["grad_accum_steps"],
                                                  facts["global_batch_size"])
        precision, source = facts["mixed_precision"], precision_source(options.mixed_precision, env)
        lines = {
            "processes": f"{world} ({machines} machine{'s' * (machines > 1)})",
            "device": facts["device"],
            "distributed type": facts["distributed_type"],
            "mixed precision": f"{precision} ({source})",
            "per-device batch": str(per_device) + _auto(facts.get("auto_batch")),
            "accumulation": f"{accumulation} micro-step{'s' * (accumulation > 1)} per optimizer step",
            "global batch": f"{global_batch} = {_processes(world)} x {per_device} x {accumulation}"
                            + _derived(global_batch_derived, global_batch),
            "steps per epoch": str(facts["steps_per_epoch"]),
            "total steps": f"{facts['total_steps']} optimizer steps",
            "epochs": str(epochs),
            "loader": _loader(facts["loader"], workers, facts["data_source"]),
            "task": options.task,
            "model": model,
            "examples": _examples(*examples),
            **training_lines(options, warmup, global_batch, optimization or {}, counts_tokens),
        }
        if debug_mode(options).on:
            lines["debug"] = debug_changes(options, facts["total_steps"], data_sizes[0][1] if data_sizes else None)
            if data_sizes:
                lines["debug data"] = "; ".join(f"{name} set: its first {kept} of {full} samples" for name, (kept, full)
                                                in zip(("training", "eval"), data_sizes, strict=False))
        local = local_world_size(world // max(machines, 1) or 1, env)
        warnings = mistakes(facts["device"], local, precision, source, cpus)
        return cls(lines, warnings)

    def text(self, warnings: bool = True) -> str:
        """The header, then one aligned ``label: value`` line each, the start last; the warnings too unless the
        console shows them as ``accel_ddp: warning:`` lines of their own."""
        rows = {**self.lines, "start": self.start}
        rows.update({"warning" if len(self.warnings) == 1 else f"warning {i}": w
                     for i, w in enumerate(self.warnings, 1) if warnings})
        width = max(map(len, rows)) + 1
        return "\n".join([HEADER, *(f"  {f'{label}:':<{width}} {value}" for label, value in rows.items())]) + "\n"

    def say(self, is_main: bool) -> None:
        """The start-up block on stdout and its warnings on stderr, once (main process)."""
        if is_main:
            write(self.text(warnings=False), end="")
            for warning in self.warnings:
                warn(warning)

    def as_dict(self) -> dict[str, Any]:
        """config.yaml's ``startup:`` section: the same lines (whole numbers as numbers), the warnings as a list."""
        lines = {label: int(value) if value.isdigit() else value for label, value in self.lines.items()}
        return {**lines, "start": self.start, "warnings": list(self.warnings)}


def describe_run(options: StartupOptions, facts: dict[str, Any], epochs: int, train_loader: Any, model: str, data: Any,
                 optimization: dict[str, str], cpus: int, *, warmup: int, global_batch_derived: bool,
                 counts_tokens: bool = False) -> StartupBlock:
    """``assemble.setup``'s start-up block, before the start point is known (``checkpoint/start.agree_start`` adds
    it): the run's facts, its loader's workers, its data sets' sizes (``data``: data/resolve.py's), the model."""
    return StartupBlock.describe(options, facts, epochs=epochs, workers=_workers(train_loader), model=model,
                                 warmup=warmup, global_batch_derived=global_batch_derived,
                                 data_sizes=_debug_sizes(debug_mode(options).on, data), cpus=cpus,
                                 examples=(_length(data.train), _length(data.eval)), optimization=optimization,
                                 counts_tokens=counts_tokens)


def _workers(loader) -> int | None:
    """DataLoader workers per rank of a training loader (HostLoader wraps a DataLoader); None for the device loader."""
    inner = getattr(loader, "loader", loader)
    return getattr(loader, "num_workers", getattr(inner, "num_workers", None))


def _debug_sizes(debug: bool, data: Any) -> tuple[tuple[int, int], ...]:
    """--debug: (kept, full) samples of the training and eval sets that data/resolve.py cut to a Subset."""
    from torch.utils.data import Subset  # torch only here: the block's lines are read without it

    sets = [d for d in (data.train, data.eval) if isinstance(d, Subset)] if debug else []
    return tuple((len(d), len(d.dataset)) for d in sets if len(d) < len(d.dataset))


def _length(dataset) -> int | None:
    """Samples in ``dataset`` for the start-up block; None for a stream (or no dataset)."""
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:  # an iterable dataset without __len__
        return None


def training_lines(options: StartupOptions, warmup: int, global_batch: int,
                   optimization: dict[str, str] | None = None, counts_tokens: bool = False) -> dict[str, str]:
    """What the Trainer's block says besides the layout: optimizer, learning rate and its schedule (``warmup``: its
    warmup in optimizer steps), seed, where the run writes, how often it saves, what it reports to, and the tokens of
    a step for a token task (``counts_tokens``). ``optimization``: a user's optimizer or schedule, Muon's split
    (``optimizer``, ``learning rate``, ``optimizer split``)."""
    optimization = optimization or {}
    clip = f"gradients clipped to norm {options.max_grad_norm:g}" if options.max_grad_norm else "no gradient clipping"
    decay = {"constant": "then constant", "linear": "then linear to 0", "cosine": "then cosine to 0"}
    kwargs = f" {options.optimizer_kwargs}" if options.optimizer_kwargs else ""
    flags = f"{options.optimizer}{kwargs}, weight decay {options.weight_decay:g}"
    schedule = decay.get(options.lr_schedule, options.lr_schedule)
    lines = {
        "optimizer": f"{optimization.get('optimizer', flags)}, {clip}",
        **({"optimizer split": optimization["optimizer split"]} if "optimizer split" in optimization else {}),
        "learning rate": optimization.get("learning rate", f"{options.lr:g} after {warmup} warmup step"
                                          f"{'s' * (warmup != 1)}, {schedule}"),
        "seed": str(options.seed),
        "output folder": options.output_dir + (f" (checkpoints in {options.checkpoint_dir})"
                                               if options.checkpoint_dir else ""),
        "checkpoints": _cadence(options.checkpointing_steps, options.keep_last),
        "trackers": f"{options.report_to}, and metrics.jsonl" if options.with_tracking else
                    "metrics.jsonl only (--report_to NAME adds one)",
    }
    if counts_tokens:  # a token task: the step's unit people compare
        length = options.max_length
        lines["tokens per step"] = (f"{global_batch * length:,} = {global_batch} sequences x {length}"
                                    + ("" if options.packing else " at most (padding is not trained on)"))
    return lines


def _cadence(every: str | None, keep: int) -> str:
    if every is None:
        return "none saved (--checkpointing_steps N saves every N optimizer steps)"
    when = "each epoch" if str(every) == "epoch" else f"every {every} optimizer steps"
    return f"{when}, the newest {keep} kept"


def _examples(train: int | None, evaluated: int | None) -> str:
    first = f"{train:,} training" if train is not None else "training set streamed (size unknown)"
    return f"{first}, {f'{evaluated:,} eval' if evaluated is not None else 'no eval set'}"


def _derived(derived: bool, global_batch: int) -> str:
    """After the global batch a per-device batch made (the Trainer's meaning), how to keep it on another world size."""
    if not derived:
        return ""
    return f" (from the per-device batch: it changes with the processes; --global_batch_size {global_batch} keeps it)"


def precision_source(flag: str | None, env=os.environ) -> str:
    """Where the precision came from: --mixed_precision, the launch config (``accelerate launch`` sets
    ``ACCELERATE_MIXED_PRECISION`` from it, accelerate/commands/launch.py), or Accelerate's default."""
    if flag is not None:
        return "--mixed_precision"
    return "launch config" if env.get("ACCELERATE_MIXED_PRECISION") else "default: no launch config"


def resumed_from(step: int, folder: str | None) -> str:
    return f"resumed from step {step} of checkpoint {folder}"


def debug_changes(options: StartupOptions, total_steps: int, full_train: int | None) -> str:
    """What --debug changed besides the data (assemble.setup, data/resolve.py and distributed/world.py apply it);
    ``full_train``: the training set's samples before --debug cut it (None: not cut)."""
    before = options.max_steps or (options.epochs * (full_train // options.global_batch_size) if full_train else None)
    steps = f"cut to {total_steps} optimizer steps (from {before})" if before and before > total_steps else \
        f"{total_steps} optimizer steps (at most {debug_mode(options).max_steps})"
    return f"{steps}; {debug_mode(options).changes()}"


def mistakes(device: str, local_processes: int, precision: str, source: str, cpus: int,
             cpu_bf16: bool | None = None) -> list[str]:
    """What looks like a launch config meant for another machine: half precision on CPU, more CPU ranks than cores.

    bf16 on CPU gets the doctor's verdict (util/cpu_bf16.py); ``cpu_bf16``: the CPU has bf16 units (None: read them).
    Asked for with --mixed_precision on a CPU that has them, it is no mistake."""
    found = []
    if device == "cpu" and precision == "bf16" and cpu_bf16 is None:
        cpu_bf16 = cpu_has_bf16_units(read_cpuinfo())
    asked_where_it_may_pay = precision == "bf16" and cpu_bf16 and source == "--mixed_precision"
    if device == "cpu" and precision in ("bf16", "fp16", "fp8") and not asked_where_it_may_pay:
        what = {"bf16": cpu_bf16_verdict(bool(cpu_bf16)),
                "fp16": "Accelerate trains in fp32 on CPU (no fp16 autocast there)",
                "fp8": "fp8 needs a GPU that has it"}[precision]
        hint = ("; this looks like a GPU launch config on a machine without a usable GPU: for CPU use "
                "mixed_precision: 'no' (accelerate_configs/cpu_2proc.yaml) or --mixed_precision no"
                if source == "launch config" else "; give --mixed_precision no unless you measured it")
        found.append(f"{_processes(local_processes)} on CPU in {precision} ({source}): {what}{hint}")
    if device == "cpu" and local_processes > cpus:
        found.append(f"{local_processes} processes on CPU share {cpus} core(s) here, so each step waits for the "
                     "slowest; if the launch config was meant for GPUs, this machine has none torch can use; "
                     f"launch with --num_processes {cpus} or fewer")
    return found


def _auto(chosen: dict[str, Any] | None) -> str:
    """How --per_device_batch_size auto found the size (batch_size.ChosenBatch.facts), or ''."""
    if not chosen:
        return ""
    how = "the resumed checkpoint's" if chosen["from"] == "checkpoint" else \
        f"the largest that fits, of {', '.join(map(str, chosen['tried']))}"
    return f" (--per_device_batch_size {chosen['requested']}: {how})"


def _processes(count: int) -> str:
    return f"{count} process{'es' * (count != 1)}"


def _loader(kind: str, workers: int | None, source: str) -> str:
    what = {"device": "device (the training set held on the device)", "dataloader": "dataloader",
            "streaming": "streaming"}.get(kind, kind)
    if workers is not None and kind != "device":
        what += f" with {workers} worker{'s' * (workers != 1)} per rank"
    return f"{what}; {SOURCES.get(source, source)}"
