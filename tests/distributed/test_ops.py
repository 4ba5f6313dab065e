"""Operations: multi-node on loopback, the SLURM script, FSDP, the launch configs (trackers:
tracking/test_trackers.py; curves.png: tracking/test_report.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.multiproc import free_port
from tests.helpers.output import series
from tests.helpers.runs import (
    REPO,
    check,
    gpu_count,
    gpu_env,
    launch,
    launch_machines,
    launcher_env,
    load_weights,
    read_metrics,
    read_summary,
    suite_env,
    train_ranks,
)

CONFIGS = REPO / "accelerate_configs"
TWO_NODE = CONFIGS / "2node_8gpu.yaml"
FSDP = CONFIGS / "fsdp_4gpu.yaml"
SBATCH = CONFIGS / "slurm" / "train.sbatch"


# ----------------------------------------------------------------------------- the new launch configs


@pytest.mark.parametrize(("path", "distributed_type", "processes", "machines"), [
    (TWO_NODE, "MULTI_GPU", 8, 2), (FSDP, "FSDP", 4, 1)])
def test_new_launch_configs_load_and_comment_every_key(path, distributed_type, processes, machines):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert (config.distributed_type.value, config.num_processes, config.num_machines) == (
        distributed_type, processes, machines)
    if distributed_type == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_cpu_ram_efficient_loading"] is False  # else launch demands sync_module_states
    lines = path.read_text().splitlines()
    for previous, line in zip(["", *lines], lines, strict=False):
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line or previous.lstrip().startswith("#"), f"{path.name}: {line!r} has no comment"


# ----------------------------------------------------------------------------- multi-node on loopback


@pytest.mark.slow
def test_two_machines_on_loopback_form_one_world_and_match_one_process(tmp_path, tiny_args):
    multi = tmp_path / "two_machines"
    codes, logs = launch_machines([*tiny_args, "--output_dir", str(multi)], 4, tmp_path)
    assert codes == [0, 0], {rank: log[-3000:] for rank, log in logs.items()}

    single = tmp_path / "one_process"
    train_ranks([*tiny_args, "--output_dir", str(single)], world_size=1)

    summary = read_summary(multi)
    assert (summary["world_size"], summary["num_machines"]) == (4, 2)
    assert (summary["per_device_batch_size"], summary["grad_accum_steps"], summary["global_batch_size"]) == (8, 1, 32)
    assert summary["optimizer_steps"] == read_summary(single)["optimizer_steps"] == 16
    reference, weights = load_weights(single), load_weights(multi)
    assert weights.keys() == reference.keys()
    for key in reference:
        assert torch.allclose(weights[key], reference[key], atol=1e-5), key


# ----------------------------------------------------------------------------- signals through the launcher


SIGNAL_PROBE = """
import os, signal, sys, time
received = []
signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
print(f"READY {os.environ['RANK']}", flush=True)
deadline = time.time() + 60
while not received and time.time() < deadline:
    time.sleep(0.05)
time.sleep(1)  # "save a checkpoint": the launcher must wait for it
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}"), "w") as fh:
    fh.write(str(received))
sys.exit(3 if received else 0)
"""


@pytest.mark.slow
def test_usr1_to_accelerate_launch_reaches_every_rank(tmp_path):
    """What train.sbatch relies on: with PET_SIGNALS_TO_HANDLE, torchrun forwards USR1 to the workers
    and waits for them (without it the launcher dies on USR1 and orphans them)."""
    probe = tmp_path / "probe.py"
    probe.write_text(SIGNAL_PROBE)
    env = suite_env({"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"})
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"),
           "--main_process_port", str(free_port()), str(probe), str(tmp_path)]
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.time() + 120
        while log.read_text().count("READY") < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0, log.read_text()[-3000:]  # non-zero: the sbatch script requeues on it
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == f"[{int(signal.SIGUSR1)}]", log.read_text()[-3000:]


# ----------------------------------------------------------------------------- the SLURM script, with fake srun


FAKE_SRUN = r"""#!/bin/bash
# srun stand-in: the task once per node with SLURM_NODEID set; signals forwarded to the tasks.
pids=()
trap 'kill -USR1 "${pids[@]}" 2>/dev/null' USR1
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
while [[ "$1" == --* ]]; do echo "$1" >> "$FAKE_LOG/srun_flags"; shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do
  while :; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done
  if [[ $rc -ne 0 ]]; then status=$rc; fi
done
exit $status
"""
FAKE_ACCELERATE = r"""#!/bin/bash
# accelerate stand-in: records its arguments; like train.py, exits 3 after a signal ("checkpoint saved").
log="$FAKE_LOG/node$SLURM_NODEID"
printf '%s\n' "$@" > "$log.args"
env | grep -E '^(PET_SIGNALS_TO_HANDLE|TORCH_ELASTIC_SHUTDOWN_TIMEOUT)=' | sort > "$log.env"
got=""
trap 'got=USR1' USR1
trap 'got=TERM' TERM
touch "$log.ready"
for ((i = 0; i < 600; i++)); do
  if [[ -n "$got" || "$FAKE_MODE" == finish ]]; then break; fi
  sleep 0.05
done
echo "$got" > "$log.signal"
if [[ -n "$got" ]]; then exit 3; fi
"""
FAKE_SCONTROL = r"""#!/bin/bash
case "$1" in
  show) printf 'node-a\nnode-b\n' ;;
  requeue) echo "$2" >> "$FAKE_LOG/requeued" ;;
esac
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir, log_dir = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("accelerate", FAKE_ACCELERATE), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log_dir),
           "FAKE_MODE": "wait", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "demo", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "16"}
    return env, log_dir


def run_sbatch(env: dict, log_dir: Path, cwd: Path, send: signal.Signals | None) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(["bash", str(SBATCH), "--dataset", "mnist", "--epochs", "3"], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if send is not None:
        deadline = time.time() + 30
        while (not all((log_dir / f"node{n}.ready").exists() for n in (0, 1)) and time.time() < deadline
               and proc.poll() is None):
            time.sleep(0.05)
        proc.send_signal(send)
    out, _ = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def test_sbatch_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed; `bash -n` passed")
    result = subprocess.run(["shellcheck", "-s", "bash", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_sbatch_starts_one_launcher_per_node_with_rank_address_and_port(fake_slurm, tmp_path):
    env, log_dir = fake_slurm
    result = run_sbatch({**env, "FAKE_MODE": "finish"}, log_dir, tmp_path, send=None)
    assert result.returncode == 0, result.stdout
    for node in (0, 1):
        args = (log_dir / f"node{node}.args").read_text().splitlines()
        expected = ["launch", "--config_file", "accelerate_configs/2node_8gpu.yaml", "--num_machines", "2",
                    "--num_processes", "8", "--machine_rank", str(node), "--main_process_ip", "node-a",
                    "--main_process_port", str(20000 + 4242), "train.py", "--output_dir", "outputs/demo-4242",
                    "--checkpointing_steps", "500", "--resume_from_checkpoint", "auto",
                    "--dataset", "mnist", "--epochs", "3"]
        assert args == expected
        assert (log_dir / f"node{node}.env").read_text().splitlines() == [
            "PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=110"]
    assert "--kill-on-bad-exit=1" in (log_dir / "srun_flags").read_text()
    assert not (log_dir / "requeued").exists()


def test_sbatch_forwards_usr1_to_every_node_and_requeues(fake_slurm, tmp_path):
    env, log_dir = fake_slurm
    result = run_sbatch(env, log_dir, tmp_path, send=signal.SIGUSR1)
    assert result.returncode == 0, result.stdout
    assert [(log_dir / f"node{n}.signal").read_text().strip() for n in (0, 1)] == ["USR1", "USR1"]
    assert (log_dir / "requeued").read_text().split() == ["4242"]
    assert "requeueing job 4242" in result.stdout


def test_sbatch_term_checkpoints_but_does_not_requeue_unless_asked(fake_slurm, tmp_path):
    env, log_dir = fake_slurm
    result = run_sbatch(env, log_dir, tmp_path, send=signal.SIGTERM)
    assert result.returncode == 3, result.stdout  # scancel: stop for good, with the ranks' exit code
    assert [(log_dir / f"node{n}.signal").read_text().strip() for n in (0, 1)] == ["TERM", "TERM"]
    assert not (log_dir / "requeued").exists()

    for name in os.listdir(log_dir):
        os.remove(log_dir / name)
    result = run_sbatch({**env, "REQUEUE_ON_TERM": "1"}, log_dir, tmp_path, send=signal.SIGTERM)
    assert result.returncode == 0, result.stdout
    assert (log_dir / "requeued").read_text().split() == ["4242"]


# ----------------------------------------------------------------------------- FSDP

FSDP_ON_CPU = ("Accelerate 1.15 applies FSDP only with GPU backends: on CPU, where accel_ddp asks for "
               "Accelerator(cpu=True), the processes form a MULTI_CPU gloo group and train plain DDP "
               "replicas, so there is no FSDP to smoke-test without a GPU")


def test_fsdp_config_on_cpu_trains_ddp_replicas_as_documented(tmp_path, tiny_args):
    """The reason the FSDP smoke test needs GPUs, checked rather than assumed: two ranks with the environment
    `accelerate launch --config_file fsdp_4gpu.yaml --num_processes 2` gives its workers (Accelerate's own code
    computes it: runs.launcher_env) train plain DDP replicas."""
    env = launcher_env(["--config_file", str(FSDP), "--num_processes", "2", "--mixed_precision", "no"])
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"]) == ("true", "2")  # the launcher asks for FSDP2
    out = tmp_path / "run"
    train_ranks([*tiny_args, "--output_dir", str(out)], env=env)
    summary = read_summary(out)
    assert (summary["distributed_type"], summary["world_size"]) == ("MULTI_CPU", 2)


@pytest.mark.slow
@pytest.mark.gpu  # on CPU there is no FSDP to smoke-test: FSDP_ON_CPU
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])  # sgd: foreach, as fused SGD has no DTensor rule
def test_fsdp_smoke_on_gpus(tmp_path, tiny_args, optimizer):
    gpus = gpu_count()
    nproc = 4 if gpus >= 4 else 2 if gpus >= 2 else 1
    out = tmp_path / "run"
    check(launch([*tiny_args, "--optimizer", optimizer, "--output_dir", str(out)], nproc=nproc, env=gpu_env(),
                 launch_args=["--config_file", str(FSDP)]))
    summary = read_summary(out)
    assert (summary["distributed_type"], summary["world_size"]) == ("FSDP", nproc)
    losses = series(read_metrics(out), "loss")[1]
    assert losses[-1] < losses[0]
    weights = load_weights(out)  # gathered into full, unsharded tensors
    assert weights["1.weight"].shape == (32, 64)
