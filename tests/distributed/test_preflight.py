"""Preflight checks (accel_ddp/distributed/preflight.py) on a CPU machine, with GPUs, drivers and FSDP faked.

What each guards against happens only on GPU machines or clusters: two ranks on one GPU (NCCL's
"Duplicate GPU detected"), a CUDA build of torch on a driver too old for it (a quiet fall back to
the CPU), FSDP2 combinations that fail, a checkpoint folder that is not shared between machines.
Here torch's view of the machine is monkeypatched inside forked ranks, and ``main()`` must stop
with one line and exit code 2 before anything is written.
"""

from __future__ import annotations

import io
import os
from contextlib import redirect_stderr

import pytest
import torch
from torch import nn

import accel_ddp.distributed.preflight as preflight
from accel_ddp.cli.doctor import ERROR
from accel_ddp.cli.machine import MachineFacts
from accel_ddp.cli.train import main
from accel_ddp.distributed.preflight import (
    DeviceError,
    build_fsdp_plugin,
    check_fsdp,
    check_launch_devices,
    unusable_gpus,
)
from tests.helpers.doctor import check_file, only
from tests.helpers.multiproc import run_ranks
from tests.helpers.runs import CPU_2PROC, REPO

CONFIGS = REPO / "accelerate_configs"
TINY = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--model", "mlp",
        "--hidden_size", "8", "--global_batch_size", "16", "--max_steps", "2"]
TOO_OLD = ("The NVIDIA driver on your system is too old (found version 11040). Please update your GPU driver by "
           "downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx")


def _main_with_stderr(args: list[str], patch=None) -> tuple[int, str]:
    """``main(args)`` on this rank after ``patch()``; the exit code and what went to stderr."""
    if patch is not None:
        patch()
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(args)
    return code, err.getvalue()


def _one_gpu() -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1


def _gpus_torch_cannot_use() -> None:
    torch.cuda.is_available = lambda: False
    torch.version.cuda = "13.0"
    torch.cuda._device_count_nvml = lambda: 4  # the driver lists four GPUs

    def init():
        raise RuntimeError(TOO_OLD)

    torch.cuda.init = init


def _assert_refused(outcomes, tmp_path, *words: str) -> None:
    codes = [code for code, _ in outcomes]
    assert codes == [2] * len(outcomes)
    # One line in all, from the rank that failed first (accel_ddp.lifecycle.failure): every other rank is quiet.
    lines = [line for _, err in outcomes for line in err.strip().splitlines()]
    assert len(lines) == 1 and lines[0].startswith("accel_ddp: error: "), outcomes
    assert all(word in lines[0] for word in words), lines[0]
    assert not any(tmp_path.iterdir())  # refused before anything was written


# ----------------------------------------------------------------------------- more ranks than GPUs (finding 1)


def test_more_ranks_than_gpus_stop_before_the_process_group_forms(tmp_path):
    """Two ranks, one GPU: Accelerate would put both on cuda:0 and NCCL stop at the first collective."""
    outcomes = run_ranks(lambda: _main_with_stderr([*TINY, "--output_dir", str(tmp_path)], _one_gpu), world_size=2)
    _assert_refused(outcomes, tmp_path, "2 processes on this machine but only 1 GPU(s) visible",
                    "Duplicate GPU detected", "--num_processes 1", "CUDA_VISIBLE_DEVICES=''")


def test_one_rank_per_gpu_passes_the_guard(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_launch_devices(cuda_available=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    with pytest.raises(DeviceError, match="5 processes on this machine but only 4 GPU"):
        check_launch_devices(cuda_available=True)


def test_doctor_names_what_really_happens_with_more_processes_than_gpus():
    report = check_file(CPU_2PROC, MachineFacts(gpu_count=1, nccl_available=True, cpu_count=8))
    finding = only(report, ERROR, "2 process(es) on this machine but only 1 GPU(s)", "Duplicate GPU detected")
    assert "invalid device ordinal" not in finding.line() and "num_processes: 1" in finding.fix


# ----------------------------------------------------------------------------- a driver too old for this torch (7)


def test_gpus_this_torch_cannot_use_refuse_the_launch(tmp_path):
    """A CUDA build on a driver too old for it: is_available() is False; the run must not quietly use the CPU."""
    outcomes = run_ranks(lambda: _main_with_stderr([*TINY, "--output_dir", str(tmp_path)], _gpus_torch_cannot_use),
                         world_size=2)
    _assert_refused(outcomes, tmp_path, "4 NVIDIA GPU(s)", "CUDA 13.0", "driver on your system is too old",
                    "install the torch build that matches the driver", "CUDA_VISIBLE_DEVICES=''")


@pytest.mark.parametrize("cuda_build", ["13.0", None])
def test_cpu_training_stays_allowed_without_usable_gpu_evidence(monkeypatch, cuda_build):
    """This machine as it is (the suite hides its GPUs, if any, whatever the torch build), then either build of torch
    as the test sets it: no GPU listed by the driver lets a CPU run start; four listed refuse it on a CUDA build of
    torch only (a CPU-only build has nothing to use them with)."""
    assert unusable_gpus() == (0, "")
    check_launch_devices(cuda_available=False)

    def init():
        raise RuntimeError(TOO_OLD)

    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", init)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 0)  # no driver, or every GPU hidden
    assert unusable_gpus() == (0, "")
    check_launch_devices(cuda_available=False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 4)
    assert unusable_gpus() == ((4, " ".join(TOO_OLD.split())) if cuda_build else (0, ""))


def test_doctor_reports_gpus_this_torch_cannot_use():
    facts = MachineFacts(gpu_count=0, cpu_count=16, unusable_gpus=4, cuda_problem=TOO_OLD)
    report = check_file(CONFIGS / "4gpu.yaml", facts)
    finding = only(report, ERROR, "4 NVIDIA GPU(s)", "cannot use them", "too old", "refuses to launch")
    assert "torch build that matches the driver" in finding.fix and "CUDA_VISIBLE_DEVICES=''" in finding.fix
    assert not any("no GPU here" in f.problem for f in report.findings)  # not the "fine for a CPU run" note
    assert "4 listed by the driver that this torch cannot use" in facts.describe()


# ----------------------------------------------------------------------------- FSDP2 (findings 3-5)


def _fsdp2_everywhere() -> None:
    from accelerate import Accelerator

    Accelerator.is_fsdp2 = property(lambda self: True)  # only in this forked rank: the launch asked for FSDP2


def test_fsdp_with_channels_last_is_refused_before_training(tmp_path):
    outcomes = run_ranks(lambda: _main_with_stderr(
        [*TINY, "--channels_last", "--output_dir", str(tmp_path)], _fsdp2_everywhere), world_size=1)
    assert [code for code, _ in outcomes] == [2]
    assert "--channels_last with FSDP" in outcomes[0][1] and "4gpu.yaml" in outcomes[0][1]
    assert not (tmp_path / "config.yaml").exists()


def test_fsdp_option_checks():
    with_bn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    plain = nn.Sequential(nn.Linear(4, 4))
    check_fsdp(plain, channels_last=False, mixed_precision="bf16")
    check_fsdp(with_bn, channels_last=False, mixed_precision="no")  # fp32: BatchNorm is fine
    for precision in ("bf16", "fp16"):
        with pytest.raises(DeviceError, match=f"BatchNorm under FSDP with mixed_precision {precision}.*"
                                              "torchtitan/issues/674.*--mixed_precision no"):
            check_fsdp(with_bn, channels_last=False, mixed_precision=precision)
    with pytest.raises(DeviceError, match="non-contiguous parameters"):
        check_fsdp(plain, channels_last=True, mixed_precision="no")


FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_MIXED_PRECISION": "bf16"}


def test_fsdp2_reduces_gradients_in_fp32(monkeypatch):
    """Accelerate's own FSDP2 bf16 policy reduce-scatters gradients in bf16; ours computes in bf16, reduces in fp32."""
    for name, value in FSDP2_ENV.items():
        monkeypatch.setenv(name, value)
    plugin = build_fsdp_plugin(cuda_available=True)
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    plugin.set_mixed_precision("bf16")  # what AcceleratorState does with the plugin: it must keep ours
    assert plugin.mixed_precision_policy.reduce_dtype == torch.float32

    assert build_fsdp_plugin(cuda_available=False) is None  # on CPU Accelerate applies no FSDP at all
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert build_fsdp_plugin(cuda_available=True).mixed_precision_policy is None  # fp32 throughout already
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert build_fsdp_plugin(cuda_available=True) is None


# ----------------------------------------------------------------------------- two machines: one folder (finding 10)


def _blind_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        preflight._reads_token = lambda path, token: False  # as if machine 1 had its own local disk


@pytest.mark.parametrize("shared", [True, False])
def test_output_dir_must_be_shared_between_machines(tmp_path, shared):
    """Two ranks, one per "machine" (LOCAL_WORLD_SIZE=1): the main process's probe file must be seen by all."""
    out = tmp_path / "run"
    outcomes = run_ranks(lambda: _main_with_stderr([*TINY, "--output_dir", str(out)],
                                                   None if shared else _blind_on_rank_1),
                         world_size=2, env={"LOCAL_WORLD_SIZE": "1"})
    if shared:
        assert [code for code, _ in outcomes] == [0, 0]
        assert not [p for p in os.listdir(out) if p.startswith(".accel_ddp-shared")]  # the probe is gone
        return
    _assert_refused(outcomes, tmp_path, f"--output_dir {out} is not shared", "1 of 2 ranks",
                    "file system every machine mounts")


def test_doctor_notes_the_shared_file_system_for_several_machines():
    report = check_file(CONFIGS / "2node_8gpu.yaml", MachineFacts(gpu_count=4, nccl_available=True, cpu_count=32))
    assert report.ok and len(report.footnotes) == 1
    assert "note: the 2 machines need --output_dir on a file system they all mount" in report.render()
    report = check_file(CONFIGS / "4gpu.yaml", MachineFacts(gpu_count=4, nccl_available=True, cpu_count=32))
    assert report.footnotes == [] and "file system" not in report.render()
