"""The GPU paths, one check per call: the `paths` stages of benchmarks/gpu_first_minutes.sh, the one GPU entry,
which runs each under its own timeout (``bash benchmarks/gpu_first_minutes.sh --only paths``).

    python benchmarks/gpu_check.py doctor --out /tmp/first          # OUT/doctor.json, its launches' logs in OUT/doctor/
    python benchmarks/gpu_check.py resume_bitwise --dry-run         # no GPU: the same check on the CPU, plumbing only

A call prints a mode line, then ``PASS|FAIL|SKIP  name  seconds  figure``; exit code 1 on FAIL. Its launches get at
most ``--budget`` seconds together (the stage's ``$STAGE_SECONDS``). Checks that need two GPUs say so and skip on a
one-GPU machine. Without a GPU (or with ``--dry-run``) a check runs on the CPU with the same commands (same configs,
scripts and assertions, the device ``cpu`` and the backend gloo): the plumbing, not the GPU. What stays GPU-only is
skipped: the one-process-per-GPU guard, FSDP2 (Accelerate applies it only on GPUs), the GPU tests.

    doctor              accel-ddp doctor on accelerate_configs/1gpu_debug.yaml: "ready"
    bf16_device_loader  1gpu_debug.yaml (bf16): --loader device, checkpoints every 10 steps
    resume_bitwise      a crash at step 25 (tests/helpers/faults.py), --resume_from_checkpoint auto: final weights
                        bitwise equal to an uninterrupted run's
    nccl_one_rank       one rank through torchrun: NCCL set-up, barrier, broadcast, all-reduce, and the preemption
                        flag's gloo sub-group next to the NCCL group (gpu_first_checks.py's nccl probe)
    preempt_resume      a real 1-rank NCCL run: SIGTERM -> checkpoint + "preempted" -> resume to the end
    gpu_guard           more ranks than GPUs: every rank stops with one line before NCCL
    gloo_two_ranks      two ranks on one GPU over gloo (gloo_on_one_gpu.py): DDP, the device loader, checkpoints,
                        then a resume with the DataLoader loader
    auto_batch_oom      --per_device_batch_size auto in a process allowed 2 GiB of the GPU (capped_memory.py): the
                        first micro-batch (65536 samples, ~4.6 GiB) really runs out of memory, the probe halves
                        until one fits (16384, ~1.4 GiB), the run finishes, its weights equal a run started there
    compile             --compile: plain keys in model.safetensors and checkpoints; resume without compile
    fsdp2_one_rank      fsdp_4gpu.yaml on one rank (gpu_first_checks.py's fsdp probe): policy applied (fp32 reduce),
                        the premises of the refusals, train + checkpoint + resume + full export, SGD (foreach)
    nccl_two_ranks      two GPUs: the NCCL probe and a checkpointed run on two ranks (else SKIP)
    pytest_gpu          pytest -m gpu (the tests that need a GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, bench_env, free_port  # noqa: E402

CONFIGS = REPO / "accelerate_configs"
HERE = REPO / "benchmarks"
PROBE = HERE / "gpu_first_checks.py"  # its `probe nccl|fsdp OUT_JSON`, run under a launch
FAULTY_TRAIN = REPO / "tests" / "scripts" / "faulty_train.py"
DIGITS_MLP = ["--dataset", "digits", "--model", "mlp"]
MLP_KEYS = {"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}


class CheckFailed(AssertionError):
    """A check's expectation did not hold; the message is its figure."""


class Skip(Exception):  # noqa: N818 - an outcome
    """The check cannot run here (no GPU, one GPU, no time): the message says why."""


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    seconds: float
    figure: str

    def line(self) -> str:
        return f"{self.status:4}  {self.name:20} {self.seconds:6.1f}s  {self.figure}"


class Session:
    """What every check needs: the mode, the output folder, the clock, and how to launch."""

    def __init__(self, out: Path, gpus: int, bf16: bool, dry_run: bool, budget: float):
        self.out, self.gpus, self.bf16, self.dry_run = out, gpus, bf16, dry_run
        self.gpu = gpus > 0 and not dry_run
        self.deadline = time.monotonic() + budget
        self.device = "cuda" if self.gpu else "cpu"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = bench_env(threads=max(1, (os.cpu_count() or 2) // 2), extra=extra)
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS: resume_bitwise compares bits
        if not self.gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a dry run stays on the CPU even where a GPU exists
        return env

    def run(self, folder: Path, name: str, cmd: list[str], env: dict[str, str] | None = None,
            limit: float = 240) -> tuple[int, str]:
        """Run ``cmd`` (logs to ``folder/name.log``); its exit code and output. Raises Skip when out of time."""
        timeout = min(limit, self.remaining())
        if timeout < 10:
            raise Skip("out of time (--budget)")
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / f"{name}.log"
        try:
            done = subprocess.run(cmd, env=env or self.env(), cwd=REPO, capture_output=True, text=True,
                                  timeout=timeout)
            code, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as err:
            code = -1
            text = _text(err.stdout) + _text(err.stderr) + f"\n[gpu_check: killed after {timeout:.0f}s]"
        log.write_text(f"$ {' '.join(map(str, cmd))}\n{text}")
        return code, text

    def launch(self, folder: Path, name: str, config: str, script: Path, args: list[str], nproc: int | None = None,
               env: dict[str, str] | None = None, limit: float = 240) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
               "--main_process_port", str(free_port())]
        if nproc is not None:
            cmd += ["--num_processes", str(nproc)]
        return self.run(folder, name, [*cmd, str(script), *map(str, args)], env, limit)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def ok(code: int, text: str, what: str) -> None:
    expect(code == 0, f"{what} exited {code}: {_last_error(text)}")


def _last_error(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    picked = [line for line in lines if "error" in line.lower() or "Error" in line][-1:] or lines[-1:]
    return picked[0][:300] if picked else "(no output)"


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def checkpoints(folder: Path) -> list[str]:
    root = folder / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) if root.is_dir() else []


def weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


# ----------------------------------------------------------------------------- the checks


def check_doctor(s: Session, out: Path) -> str:
    code, text = s.run(out, "doctor", [sys.executable, "-m", "accel_ddp", "doctor", "--config_file",
                                       str(CONFIGS / "1gpu_debug.yaml")], limit=120)
    machine = next((line.strip() for line in text.splitlines() if line.strip().startswith("machine:")), "?")
    verdict = next((line for line in text.splitlines() if "error(s)" in line), "no verdict line")
    if s.gpu:
        expect(code == 0 and verdict.startswith("ready"), f"doctor exited {code}: {verdict}")
        return f"{verdict}; {machine}"
    expect(code in (0, 1) and "error(s)" in verdict, f"doctor exited {code}: {_last_error(text)}")
    return f"plumbing only: {verdict}; {machine}"


def check_bf16_device_loader(s: Session, out: Path) -> str:
    if s.gpu and not s.bf16:
        raise Skip("this GPU has no bf16 (pre-Ampere): 1gpu_debug.yaml's bf16 does not apply")
    run = out / "run"
    code, text = s.launch(out, "train", "1gpu_debug.yaml", REPO / "train.py",
                          ["--dataset", "digits", "--model", "mnist_cnn", "--loader", "device", "--max_steps", 30,
                           "--checkpointing_steps", 10, "--output_dir", run])
    ok(code, text, "training")
    got = summary(run)
    expect((got["mixed_precision"], got["loader"], got["device"]) == ("bf16", "device", s.device),
           f"ran with {got['mixed_precision']}, loader {got['loader']}, on {got['device']}")
    expect(checkpoints(run) == ["step_00000010", "step_00000020", "step_00000030"], f"checkpoints {checkpoints(run)}")
    return (f"bf16 on {got['device']}, device loader: {got['train_samples_per_sec']:.0f} samples/s, "
            f"eval_accuracy {got['eval_accuracy']:.3f}, 3 checkpoints")


def check_resume_bitwise(s: Session, out: Path) -> str:
    args = [*DIGITS_MLP, "--loader", "device", "--max_steps", 30, "--checkpointing_steps", 10]
    reference, crashed = out / "reference", out / "crashed"
    ok(*s.launch(out, "reference", "1gpu_debug.yaml", REPO / "train.py", [*args, "--output_dir", reference]),
       "the uninterrupted run")
    code, text = s.launch(out, "crash", "1gpu_debug.yaml", FAULTY_TRAIN, [*args, "--output_dir", crashed],
                          env=s.env({"FAULT_FAIL_AT_STEP": "25:0"}))
    expect(code != 0 and "InjectedFailure" in text, f"the injected crash did not happen (exit {code})")
    ok(*s.launch(out, "resume", "1gpu_debug.yaml", REPO / "train.py",
                 [*args, "--resume_from_checkpoint", "auto", "--output_dir", crashed]), "the resumed run")
    expect(summary(crashed)["resumed_from_step"] == 20, f"resumed from step {summary(crashed)['resumed_from_step']}")
    a, b = weights(reference / "model.safetensors"), weights(crashed / "model.safetensors")
    differ = {k: float((a[k].float() - b[k].float()).abs().max()) for k in a if not a[k].equal(b[k])}
    expect(not differ, f"not bitwise equal: max |diff| {max(differ.values(), default=0):.3g} in {sorted(differ)[:3]}")
    return f"crash at step 25, resumed at 20 on {s.device}: final weights bitwise equal ({len(a)} tensors)"


def check_nccl_one_rank(s: Session, out: Path) -> str:
    answer = out / "probe.json"
    ok(*s.launch(out, "probe", "cpu_2proc.yaml", PROBE, ["probe", "nccl", answer], nproc=1), "the probe")
    got = json.loads(answer.read_text())
    want = "nccl" if s.gpu else "gloo"
    expect(got["backend"] == want, f"the group's backend is {got['backend']}, not {want}")
    expect(got["broadcast_ok"] and got["all_reduce"] == got["all_reduce_after_flag"] == 1.0, f"collectives: {got}")
    expect(got["flag_group_backend"] == "gloo", f"the flag's group is {got['flag_group_backend']}")
    return (f"{got['backend']} on {got['device']}: barrier, broadcast, all-reduce ok; flag all-reduce "
            f"{got['flag_all_reduce_ms']} ms over {got['flag_group_backend']}")


def check_preempt_resume(s: Session, out: Path) -> str:
    run = out / "run"
    args = [*DIGITS_MLP, "--max_steps", 300, "--checkpointing_steps", 100, "--log_every", 5, "--output_dir", run]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"),
           "--num_processes", "1", "--main_process_port", str(free_port()), str(FAULTY_TRAIN), *map(str, args)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "preempted.log", "w") as log:
        proc = subprocess.Popen(cmd, env=s.env({"FAULT_STEP_DELAY": "0.05"}), cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + min(120, s.remaining())
        while time.monotonic() < deadline and proc.poll() is None and not _logged_step(run, 20):
            time.sleep(0.5)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher forwards it to the worker
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise CheckFailed("the run did not stop within 90 s of SIGTERM") from None
    text = (out / "preempted.log").read_text()
    expect("accel_ddp: preempted:" in text, f"no 'preempted' line (exit {proc.returncode}): {_last_error(text)}")
    saved = checkpoints(run)
    expect(bool(saved), "no checkpoint after SIGTERM")
    stopped = int(saved[-1].removeprefix("step_"))
    ok(*s.launch(out, "resume", "cpu_2proc.yaml", REPO / "train.py", [*args, "--resume_from_checkpoint", "auto"],
                 nproc=1), "the resumed run")
    got = summary(run)
    expect((got["resumed_from_step"], got["optimizer_steps"]) == (stopped, 300), f"resumed {got['resumed_from_step']}")
    return f"SIGTERM -> checkpoint at step {stopped} ({got['distributed_type']}, 1 rank) -> resumed to 300"


def _logged_step(run: Path, step: int) -> bool:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return False
    return any(json.loads(line).get("step", 0) >= step for line in lines if line.strip())


def check_gpu_guard(s: Session, out: Path) -> str:
    if not s.gpu:
        raise Skip("needs a GPU: the guard counts GPUs")
    nproc = s.gpus + 1
    code, text = s.launch(out, "launch", "cpu_2proc.yaml", REPO / "train.py",
                          [*DIGITS_MLP, "--max_steps", 5, "--output_dir", out / "run"], nproc=nproc)
    line = next((x for x in text.splitlines() if x.startswith("accel_ddp: error:")), "")
    expect(code != 0 and "Duplicate GPU" in line and not (out / "run" / "config.yaml").exists(),
           f"exit {code}, error line {line!r}")
    return f"{nproc} ranks on {s.gpus} GPU(s): refused up front ({line[:90]}...)"


def check_gloo_two_ranks(s: Session, out: Path) -> str:
    run = out / "run"
    args = [*DIGITS_MLP, "--checkpointing_steps", 10, "--output_dir", run]
    ok(*s.launch(out, "train", "cpu_2proc.yaml", HERE / "gloo_on_one_gpu.py",
                 [*args, "--loader", "device", "--max_steps", 20], nproc=2), "two ranks with the device loader")
    first = summary(run)
    expect((first["world_size"], first["device"], first["loader"]) == (2, s.device, "device"), f"ran as {first}")
    ok(*s.launch(out, "resume", "cpu_2proc.yaml", HERE / "gloo_on_one_gpu.py",
                 [*args, "--loader", "dataloader", "--max_steps", 30, "--resume_from_checkpoint", "auto"], nproc=2),
       "the resume with the DataLoader loader")
    got = summary(run)
    expect((got["resumed_from_step"], got["optimizer_steps"], got["loader"]) == (20, 30, "dataloader"), f"{got}")
    expect(checkpoints(run)[-1] == "step_00000030", f"checkpoints {checkpoints(run)}")
    return (f"2 ranks on one {s.device} over gloo ({got['distributed_type']}): device loader to step 20, "
            f"resumed with the DataLoader to 30, eval_accuracy {got['eval_accuracy']:.3f}")


# --per_device_batch_size auto against a real out-of-memory error. An mlp of 4096 hidden units on 1x32x32 inputs, in
# fp32: at the backward's peak a sample holds its input, both hidden outputs and two hidden-sized gradients, 1024 + 4 x
# 4096 floats = 68 KiB; the model's state (21M weights, their gradients, AdamW's two moments: the probe holds those
# too) is 0.34 GiB. So 65536 samples (4.6 GiB) and 32768 (2.5 GiB) cannot fit in 2 GiB, 16384 (1.4 GiB) can: more
# than 2x over at the start, 30% under at the end. The dry run: small sizes, no cap, nothing runs out of memory.
AUTO_GPU = {"global": 65536, "hidden": 4096, "shape": (1, 32, 32), "gib": "2"}
AUTO_CPU = {"global": 256, "hidden": 32, "shape": (1, 8, 8), "gib": ""}


def check_auto_batch_oom(s: Session, out: Path) -> str:
    size = AUTO_GPU if s.gpu else AUTO_CPU
    args = ["--dataset", "synthetic", "--synthetic_samples", size["global"], "--synthetic_shape", *size["shape"],
            "--model", "mlp", "--hidden_size", size["hidden"], "--global_batch_size", size["global"],
            "--max_steps", 2, "--loader", "dataloader", "--eval_batch_size", 1024, "--mixed_precision", "no"]
    env = s.env({"CAPPED_MEMORY_GIB": size["gib"]})
    auto, fixed = out / "auto", out / "fixed"
    ok(*s.launch(out, "auto", "1gpu_debug.yaml", HERE / "capped_memory.py",
                 [*args, "--per_device_batch_size", "auto", "--output_dir", auto], env=env), "the auto run")
    got = summary(auto)
    tried, chosen = got["auto_batch"]["tried"], got["per_device_batch_size"]
    expect(got["optimizer_steps"] == 2 and tried[0] == size["global"] and tried[-1] == chosen
           and got["grad_accum_steps"] * chosen == size["global"], f"auto: tried {tried}, {got}")
    expect(len(tried) > 1 or not s.gpu, f"the first micro-batch, {tried[0]}, did not run out of memory in 2 GiB")
    ok(*s.launch(out, "fixed", "1gpu_debug.yaml", HERE / "capped_memory.py",
                 [*args, "--per_device_batch_size", chosen, "--output_dir", fixed], env=env), "the run started there")
    a, b = weights(auto / "model.safetensors"), weights(fixed / "model.safetensors")
    differ = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    expect(differ <= 1e-6, f"the weights differ from the run started at {chosen}: max |diff| {differ:.3g}")
    how = "bitwise equal" if differ == 0 else f"max |diff| {differ:.3g}"
    return (f"{'2 GiB of ' + s.device if s.gpu else 'plumbing only, no cap'}: tried {tried}, trained at {chosen} x "
            f"{got['grad_accum_steps']}; weights vs a run started at {chosen}: {how}")


def check_compile(s: Session, out: Path) -> str:
    compiled, plain = out / "compiled", out / "plain"
    args = ["--dataset", "digits", "--model", "mnist_cnn", "--max_steps", 20, "--checkpointing_steps", 10]
    started = time.monotonic()
    ok(*s.launch(out, "compiled", "1gpu_debug.yaml", REPO / "train.py", [*args, "--compile", "--output_dir", compiled],
                 limit=300), "the compiled run")
    took = time.monotonic() - started
    for path in (compiled / "model.safetensors", compiled / "checkpoints" / "step_00000020" / "model.safetensors"):
        bad = [k for k in weights(path) if "_orig_mod" in k]
        expect(not bad, f"{path.relative_to(out)} has compiled keys {bad[:2]}")
    ok(*s.launch(out, "plain_resume", "1gpu_debug.yaml", REPO / "train.py",
                 [*args, "--output_dir", plain, "--resume_from_checkpoint",
                  compiled / "checkpoints" / "step_00000010"]), "the plain resume from the compiled checkpoint")
    expect(summary(plain)["resumed_from_step"] == 10, "the plain run did not resume at step 10")
    return f"compiled run {took:.0f}s on {s.device}: plain keys in export and checkpoints; plain resume ok"


def check_fsdp2_one_rank(s: Session, out: Path) -> str:
    if not s.gpu:
        raise Skip("needs a GPU: Accelerate applies FSDP only with GPU backends")
    answer = out / "probe.json"
    ok(*s.launch(out, "probe", "fsdp_4gpu.yaml", PROBE, ["probe", "fsdp", answer], nproc=1), "the FSDP probe")
    got = json.loads(answer.read_text())
    expect(got["is_fsdp2"] and "reduce_dtype=torch.float32" in got["applied_policy"],
           f"policy applied: {got['applied_policy']} (plugin: {got['plugin_policy']})")
    run = out / "run"
    args = [*DIGITS_MLP, "--checkpointing_steps", 10, "--output_dir", run]
    ok(*s.launch(out, "train", "fsdp_4gpu.yaml", REPO / "train.py", [*args, "--max_steps", 20], nproc=1), "training")
    ok(*s.launch(out, "resume", "fsdp_4gpu.yaml", REPO / "train.py",
                 [*args, "--max_steps", 30, "--resume_from_checkpoint", "auto"], nproc=1), "the resume")
    trained = summary(run)
    expect((trained["distributed_type"], trained["resumed_from_step"]) == ("FSDP", 20), f"{trained}")
    exported = weights(run / "model.safetensors")
    expect(set(exported) == MLP_KEYS and tuple(exported["1.weight"].shape) == (256, 64), f"export {list(exported)}")
    ok(*s.launch(out, "sgd", "fsdp_4gpu.yaml", REPO / "train.py",
                 [*DIGITS_MLP, "--optimizer", "sgd", "--max_steps", 5, "--output_dir", out / "sgd"], nproc=1),
       "SGD under FSDP2")
    premises = ", ".join(f"{k} {got[k].split(':')[0]}" for k in
                         ("fused_sgd_on_dtensors", "channels_last_params", "batchnorm_under_bf16_policy"))
    return f"FSDP2, reduce in fp32; train/checkpoint/resume/full export ok; SGD ok; premises: {premises}"


def check_nccl_two_ranks(s: Session, out: Path) -> str:
    if not s.gpu or s.gpus < 2:
        raise Skip(f"needs two GPUs (this machine has {s.gpus if s.gpu else 'none in use'})")
    answer = out / "probe.json"
    ok(*s.launch(out, "probe", "cpu_2proc.yaml", PROBE, ["probe", "nccl", answer], nproc=2), "the probe")
    got = json.loads(answer.read_text())
    expect(got["backend"] == "nccl" and got["all_reduce"] == 2.0 and got["flag_group_backend"] == "gloo", f"{got}")
    run = out / "run"
    ok(*s.launch(out, "train", "cpu_2proc.yaml", REPO / "train.py",
                 [*DIGITS_MLP, "--max_steps", 20, "--checkpointing_steps", 10, "--output_dir", run], nproc=2),
       "training on two ranks")
    expect(summary(run)["world_size"] == 2 and len(checkpoints(run)) == 2, f"{summary(run)}")
    return f"NCCL, 2 ranks: collectives ok, flag all-reduce {got['flag_all_reduce_ms']} ms; checkpointed run ok"


def check_pytest_gpu(s: Session, out: Path) -> str:
    if not s.gpu:
        raise Skip("needs a GPU (without one, pytest -m gpu skips every test)")
    code, text = s.run(out, "pytest", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                       "tests"], limit=300)
    line = next((x for x in reversed(text.splitlines()) if " passed" in x or " failed" in x or " skipped" in x), "")
    expect(code == 0 and " passed" in line, f"exit {code}: {line or _last_error(text)}")
    return line.strip("= ")


CHECKS = {
    "doctor": check_doctor,
    "bf16_device_loader": check_bf16_device_loader,
    "resume_bitwise": check_resume_bitwise,
    "nccl_one_rank": check_nccl_one_rank,
    "preempt_resume": check_preempt_resume,
    "gpu_guard": check_gpu_guard,
    "gloo_two_ranks": check_gloo_two_ranks,
    "auto_batch_oom": check_auto_batch_oom,
    "compile": check_compile,
    "fsdp2_one_rank": check_fsdp2_one_rank,
    "nccl_two_ranks": check_nccl_two_ranks,
    "pytest_gpu": check_pytest_gpu,
}


def machine(dry_run: bool) -> dict:
    """The versions and the GPUs in use. A dry run uses none, and reads the versions without importing torch (seconds
    an interpreter, on a loaded machine, for the checks that only say they skip)."""
    if dry_run:
        from importlib.metadata import version

        return {"python": sys.version.split()[0], "torch": version("torch"), "cuda": None,
                "accelerate": version("accelerate"), "gpus": 0, "gpu_names": [], "bf16": False, "cpus": os.cpu_count()}
    import accelerate
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "accelerate": accelerate.__version__, "gpus": gpus,
            "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)],
            "bf16": bool(gpus and torch.cuda.is_bf16_supported()), "cpus": os.cpu_count()}


def run_check(name: str, session: Session, out: Path) -> Result:
    """One check, its outcome as a Result: a Skip or a failed expectation is an outcome, a broken check a FAIL with
    its traceback kept in ``out/<name>/traceback.txt``."""
    started = time.monotonic()
    try:
        status, figure = "PASS", CHECKS[name](session, out / name)
    except Skip as why:
        status, figure = "SKIP", str(why)
    except CheckFailed as err:
        status, figure = "FAIL", str(err)
    except Exception as err:  # noqa: BLE001 - a broken check is a failed check, with its traceback
        status, figure = "FAIL", f"{type(err).__name__}: {err}"
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "traceback.txt").write_text(traceback.format_exc())
    return Result(name, status, time.monotonic() - started, " ".join(figure.split()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("check", choices=list(CHECKS))
    parser.add_argument("--out", default=str(REPO / "outputs" / "gpu_first"),
                        help="results folder: OUT/<check>.json, the launches' logs in OUT/<check>/")
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU even with a GPU: plumbing only")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("STAGE_SECONDS") or 480),
                        help="seconds for the check's launches (default: the stage's $STAGE_SECONDS, else 480)")
    args = parser.parse_args(argv)
    facts = machine(args.dry_run)
    dry_run = args.dry_run or facts["gpus"] == 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    mode = "dry run on the CPU (plumbing only: nothing here says the GPU paths work)" if dry_run else \
        f"GPU: {facts['gpus']} x {', '.join(sorted(set(facts['gpu_names'])))}"
    if dry_run and not args.dry_run:
        mode += "; no GPU found, so --dry-run was implied"
    print(f"gpu_check: {mode}; torch {facts['torch']} (CUDA {facts['cuda']}), accelerate {facts['accelerate']}; "
          f"budget {args.budget:.0f}s; logs under {out / args.check}", flush=True)
    result = run_check(args.check, Session(out, facts["gpus"], facts["bf16"], dry_run, args.budget), out)
    (out / f"{args.check}.json").write_text(json.dumps({**asdict(result), "mode": mode, "dry_run": dry_run,
                                                        "machine": facts}, indent=1))
    print(result.line(), flush=True)
    return 1 if result.status == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
