"""Issue 22: the start-up block, once per run from the main process, in run.log and config.yaml's startup: section."""

from __future__ import annotations

import yaml

from accel_ddp.cli.args import parse_args
from accel_ddp.config import TrainConfig
from accel_ddp.config.views import section_of
from accel_ddp.outputs.names import RUN_LOG_NAME
from accel_ddp.tracking.startup_block import HEADER, StartupBlock, StartupOptions, mistakes
from accel_ddp.util.cpu_bf16 import cpu_bf16_verdict, cpu_has_bf16_units, read_cpuinfo
from tests.helpers.runs import REPO, launcher_env, main_ranks, read_summary

ACCUMULATING = ["--dataset", "synthetic", "--synthetic_samples", "256", "--synthetic_shape", "1", "8", "8",
                "--model", "mlp", "--hidden_size", "32", "--global_batch_size", "16", "--per_device_batch_size", "4",
                "--checkpointing_steps", "8"]


def blocks(text: str) -> list[dict[str, str]]:
    """Each start-up block in ``text``, as label -> value."""
    found = []
    for chunk in text.split(HEADER)[1:]:
        rows = {}
        for line in chunk.splitlines()[1:]:
            if not line.startswith("  ") or ":" not in line:
                break
            label, _, value = line.strip().partition(":")
            rows[label] = value.strip()
        found.append(rows)
    return found


def test_two_ranks_print_one_block_with_the_batch_layout_then_a_resume_says_where(tmp_path, capfd):
    """global 16 = 2 ranks x 4 per device x 2 micro-steps; the resumed run names its step and checkpoint; both blocks
    in run.log, the latest in config.yaml, which still replays (its startup: section is not read as flags)."""
    out = tmp_path / "run"
    assert main_ranks([*ACCUMULATING, "--epochs", "2", "--output_dir", str(out)]) == [0, 0]
    printed = capfd.readouterr()
    assert printed.out.count(HEADER) == 1 and HEADER not in printed.err  # the main process only
    (block,) = blocks(printed.out)
    assert block == {
        "processes": "2 (1 machine)", "device": "cpu", "distributed type": "MULTI_CPU",
        "mixed precision": "no (default: no launch config)", "per-device batch": "4",
        "accumulation": "2 micro-steps per optimizer step", "global batch": "16 = 2 processes x 4 x 2",
        "steps per epoch": "16", "total steps": "32 optimizer steps", "epochs": "2",
        "loader": "device (the training set held on the device); data in memory", "task": "classification",
        "model": "Sequential (--model mlp), 3,466 parameters", "examples": "256 training, 64 eval",
        "optimizer": "adamw, weight decay 0, gradients clipped to norm 1",
        "learning rate": "0.003 after 0 warmup steps, then cosine to 0", "seed": "0", "output folder": str(out),
        "checkpoints": "every 8 optimizer steps, the newest 3 kept",
        "trackers": "metrics.jsonl only (--report_to NAME adds one)", "start": "fresh"}
    assert blocks((out / RUN_LOG_NAME).read_text()) == [block]
    startup = yaml.safe_load((out / "config.yaml").read_text())["startup"]
    assert startup["accumulation"] == block["accumulation"] and startup["per-device batch"] == 4
    assert startup["start"] == "fresh" and startup["warnings"] == []

    assert main_ranks([*ACCUMULATING, "--epochs", "3", "--resume_from_checkpoint", "auto",
                       "--output_dir", str(out)]) == [0, 0]
    (resumed,) = blocks(capfd.readouterr().out)
    folder = out / "checkpoints" / "step_00000032"
    assert resumed["start"] == f"resumed from step 32 of checkpoint {folder}"
    assert (resumed["total steps"], resumed["epochs"]) == ("48 optimizer steps", "3")
    assert [b["start"] for b in blocks((out / RUN_LOG_NAME).read_text())] == ["fresh", resumed["start"]]
    written = out / "config.yaml"
    assert yaml.safe_load(written.read_text())["startup"]["start"] == resumed["start"]
    replayed = parse_args(["--config", str(written), "--output_dir", str(tmp_path / "replay")])
    assert (replayed.global_batch_size, replayed.per_device_batch_size, replayed.epochs) == (16, 4, 3)

    log = (out / RUN_LOG_NAME).read_text()  # the same command again: finished, said in one line, nothing written
    assert main_ranks([*ACCUMULATING, "--epochs", "3", "--resume_from_checkpoint", "auto",
                       "--output_dir", str(out)]) == [0, 0]
    again = capfd.readouterr()
    assert again.out == f"accel_ddp: {out} already finished at step 48 (see its summary.json); nothing to do\n"
    assert again.err == ""
    assert (out / RUN_LOG_NAME).read_text() == log


def test_debug_says_what_it_cut(tmp_path, capfd):
    assert main_ranks([*ACCUMULATING, "--synthetic_samples", "512", "--epochs", "2", "--debug",
                       "--output_dir", str(tmp_path)], world_size=1) == [0]
    (block,) = blocks(capfd.readouterr().out)
    assert block["debug"].startswith("cut to 10 optimizer steps (from 64); 0 DataLoader workers; anomaly detection")
    # data/resolve.py keeps 10 x the global batch of training samples, 4 x of eval samples
    assert block["debug data"] == "training set: its first 160 of 512 samples; eval set: its first 64 of 128 samples"
    assert read_summary(tmp_path)["optimizer_steps"] == 10


def test_a_gpu_launch_config_on_a_cpu_machine_is_one_warning(tmp_path, capfd):
    """What `accelerate launch --config_file accelerate_configs/4gpu.yaml --num_processes 2` gives its workers, on a
    machine without a GPU: 2 gloo ranks in bf16 on CPU. Said once, on stderr, and kept in run.log and config.yaml."""
    env = launcher_env(["--config_file", str(REPO / "accelerate_configs" / "4gpu.yaml"), "--num_processes", "2"])
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert main_ranks([*ACCUMULATING, "--max_steps", "2", "--output_dir", str(tmp_path)], env=env) == [0, 0]
    printed = capfd.readouterr()
    verdict = cpu_bf16_verdict(cpu_has_bf16_units(read_cpuinfo()))  # the doctor's words on this CPU
    warning = (f"accel_ddp: warning: 2 processes on CPU in bf16 (launch config): {verdict}; this looks like a GPU "
               "launch config on a machine without a usable GPU")
    assert printed.err.count(warning) == 1 and "warning" not in blocks(printed.out)[0]  # not twice on a console
    assert blocks(printed.out)[0]["mixed precision"] == "bf16 (launch config)"
    assert (tmp_path / RUN_LOG_NAME).read_text().count(warning) == 1  # run.log: as the console showed it
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["startup"]["warnings"][0].startswith(
        "2 processes on CPU in bf16")


def _describe(cfg: TrainConfig, facts: dict, **kwargs) -> StartupBlock:
    """The block of a run of ``cfg``, as assemble.setup describes it (its section, warmup and derived batch)."""
    return StartupBlock.describe(section_of(cfg, StartupOptions), facts, warmup=cfg.warmup_for(facts["total_steps"]),
                                 global_batch_derived=cfg.global_batch_derived, **kwargs)


def test_likely_mistakes():
    assert mistakes("cpu", 2, "no", "launch config", cpus=2) == []  # cpu_2proc.yaml on two cores
    assert mistakes("cuda", 4, "bf16", "launch config", cpus=2) == []
    (crowded,) = mistakes("cpu", 4, "no", "launch config", cpus=2)
    assert crowded.startswith("4 processes on CPU share 2 core(s) here") and "--num_processes 2" in crowded
    (fp16,) = mistakes("cpu", 1, "fp16", "--mixed_precision", cpus=2)
    assert fp16 == ("1 process on CPU in fp16 (--mixed_precision): Accelerate trains in fp32 on CPU (no fp16 autocast "
                    "there); give --mixed_precision no unless you measured it")


def test_the_per_device_line_says_how_auto_found_it():
    facts = {"world_size": 2, "num_machines": 1, "per_device_batch_size": 8, "grad_accum_steps": 4,
             "global_batch_size": 64, "mixed_precision": "no", "device": "cpu", "distributed_type": "MULTI_CPU",
             "steps_per_epoch": 5, "total_steps": 10, "loader": "dataloader", "data_source": "memory_mapped",
             "auto_batch": {"requested": "auto", "tried": [32, 16, 8], "from": "probe"}}
    block = _describe(TrainConfig(), facts, epochs=2, workers=3, model="m", cpus=2, env={})
    assert block.lines["per-device batch"] == "8 (--per_device_batch_size auto: the largest that fits, of 32, 16, 8)"
    assert block.lines["loader"] == "dataloader with 3 workers per rank; memory-mapped (read per batch)"
    facts["auto_batch"]["from"] = "checkpoint"
    assert _describe(TrainConfig(), facts, epochs=2, workers=3, model="m", cpus=2, env={}).lines[
        "per-device batch"] == "8 (--per_device_batch_size auto: the resumed checkpoint's)"


def _facts(world: int, per_device: int, accumulation: int) -> dict:
    return {"world_size": world, "num_machines": 1, "per_device_batch_size": per_device,
            "grad_accum_steps": accumulation, "global_batch_size": world * per_device * accumulation,
            "mixed_precision": "no", "device": "cpu", "distributed_type": "MULTI_CPU", "steps_per_epoch": 5,
            "total_steps": 100, "loader": "dataloader", "data_source": "in_memory"}


def test_the_block_says_what_the_trainers_says(tmp_path):
    """Issue 40: optimizer, learning rate and schedule with the warmup, seed, output folder, checkpoint cadence,
    trackers, example counts, and a token task's tokens per step."""
    cfg = parse_args(["--task", "causal_lm", "--max_length", "128", "--packing", "--optimizer", "sgd", "--lr", "0.1",
                      "--warmup_ratio", "0.1", "--lr_schedule", "linear", "--seed", "7", "--max_grad_norm", "0",
                      "--weight_decay", "0.01", "--checkpointing_steps", "epoch", "--keep_last", "2",
                      "--with_tracking", "--report_to", "csv", "--output_dir", str(tmp_path)])
    lines = _describe(cfg, _facts(2, 8, 4), epochs=20, workers=None, model="m", env={},
                      examples=(1000, None), counts_tokens=True).lines
    assert {key: lines[key] for key in ("examples", "optimizer", "learning rate", "seed", "output folder",
                                        "checkpoints", "trackers", "tokens per step")} == {
        "examples": "1,000 training, no eval set", "optimizer": "sgd, weight decay 0.01, no gradient clipping",
        "learning rate": "0.1 after 10 warmup steps, then linear to 0", "seed": "7", "output folder": str(tmp_path),
        "checkpoints": "each epoch, the newest 2 kept", "trackers": "csv, and metrics.jsonl",
        "tokens per step": "8,192 = 64 sequences x 128"}
    plain = _describe(parse_args([]), _facts(1, 64, 1), epochs=1, workers=None, model="m", env={}).lines
    assert "tokens per step" not in plain and plain["examples"] == "training set streamed (size unknown), no eval set"
    assert plain["checkpoints"] == "none saved (--checkpointing_steps N saves every N optimizer steps)"


def test_the_optimizer_lines_say_the_keywords_muons_split_and_a_users_optimizer_and_schedule():
    """Issue 48: --optimizer_kwargs beside the name; Muon's split on a line of its own, after the optimizer's; a
    user's optimizer and schedule (accel_ddp/optim/user.py's lines) instead of the flags' words."""
    cfg = parse_args(["--optimizer", "Muon", "--optimizer_kwargs", '{"momentum": 0.9}'])
    split = "Muon for 2 hidden matrices (4 parameters), AdamW for 1 other tensor (2 parameters: 1 biases and norms)"
    lines = _describe(cfg, _facts(1, 64, 1), epochs=1, workers=None, model="m", env={},
                                  optimization={"optimizer split": split}).lines
    assert list(lines).index("optimizer split") == list(lines).index("optimizer") + 1
    assert lines["optimizer"] == 'muon {"momentum": 0.9}, weight decay 0, gradients clipped to norm 1'
    users = {"optimizer": "RAdam (train(optimizer=...)), its own learning rate, its own parameter groups",
             "learning rate": "StepLR (train(lr_scheduler=...)), stepped once per optimizer step, from 0.001"}
    lines = _describe(parse_args([]), _facts(1, 64, 1), epochs=1, workers=None, model="m", env={},
                                  optimization=users).lines
    assert lines["optimizer"] == users["optimizer"] + ", gradients clipped to norm 1"
    assert lines["learning rate"] == users["learning rate"] and "optimizer split" not in lines


def test_a_global_batch_made_by_a_per_device_batch_says_how_to_keep_it():
    """The Trainer's meaning: --per_device_train_batch_size 8 on 2 processes is a global batch of 16 (not 64), and
    the block says it changes with the processes and which flag keeps it."""
    cfg = parse_args(["--per_device_train_batch_size", "8"])
    assert cfg.batch_layout(2) == (8, 1) and cfg.global_batch_size == 16
    line = _describe(cfg, _facts(2, 8, 1), epochs=1, workers=None, model="m", env={}).lines[
        "global batch"]
    assert line == ("16 = 2 processes x 8 x 1 (from the per-device batch: it changes with the processes; "
                    "--global_batch_size 16 keeps it)")
    fixed = parse_args(["--per_device_train_batch_size", "8", "--global_batch_size", "64"])
    assert fixed.batch_layout(2) == (8, 4)
    assert _describe(fixed, _facts(2, 8, 4), epochs=1, workers=None, model="m", env={}).lines[
        "global batch"] == "64 = 2 processes x 8 x 4"


def test_the_run_and_the_doctor_give_one_verdict_on_bf16_on_a_cpu(tmp_path):
    """Issue 40: the doctor called bf16 on this CPU "usually faster, keep it", the run "usually slower". Both now say
    util/cpu_bf16.py's verdict for the CPU's units; asked for with --mixed_precision where it may pay, the run is
    silent, as the doctor's note is no warning."""
    from accel_ddp.cli.doctor_checks import _check_precision
    from accel_ddp.cli.doctor_report import Report
    from accel_ddp.cli.machine import MachineFacts

    for units in (True, False):
        facts = MachineFacts(gpu_count=0, nccl_available=False, cpu_count=2, cpu_bf16=units)
        report = Report(source=None, facts=facts)
        _check_precision(report, {}, facts, type("Launch", (), {"mixed": "bf16"})(), cpu=True)
        (finding,) = report.findings
        assert cpu_bf16_verdict(units) in finding.problem
        (warned,) = mistakes("cpu", 1, "bf16", "launch config", cpus=2, cpu_bf16=units)
        assert cpu_bf16_verdict(units) in warned
    assert mistakes("cpu", 1, "bf16", "--mixed_precision", cpus=2, cpu_bf16=True) == []
    assert len(mistakes("cpu", 1, "bf16", "--mixed_precision", cpus=2, cpu_bf16=False)) == 1
