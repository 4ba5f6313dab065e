"""`accel-ddp doctor`: one config file per finding, checked against simulated machines.

Machine facts (GPUs, NCCL, bf16) are injected, so a 4-GPU box or eight V100s are simulated on a
CPU-only runner; the port check uses a real listening socket. The slow test at the end launches
the "silent single-process traps" for real, to prove the doctor's claims about them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from accel_ddp.cli import commands as cli
from accel_ddp.cli import doctor
from accel_ddp.cli.doctor import ERROR, NOTE, WARNING, diagnose
from accel_ddp.cli.launch_config import load_launch_config
from accel_ddp.cli.machine import MachineFacts, cpu_has_bf16_units, software_versions
from tests.helpers.doctor import check_file, never_in_use, only
from tests.helpers.multiproc import free_port
from tests.helpers.runs import CPU_2PROC, REPO, check, launch_together, read_summary, suite_env

CONFIGS = REPO / "accelerate_configs"
CPU_ONLY = MachineFacts(gpu_count=0, nccl_available=False, cpu_count=2)
ONE_GPU = MachineFacts(gpu_count=1, nccl_available=True, cpu_count=8, gpu_name="NVIDIA A10")
FOUR_GPUS = MachineFacts(gpu_count=4, nccl_available=True, cpu_count=32, gpu_name="NVIDIA A100")
EIGHT_GPUS = MachineFacts(gpu_count=8, nccl_available=True, cpu_count=64, gpu_name="NVIDIA H100")
EIGHT_V100 = MachineFacts(gpu_count=8, nccl_available=True, bf16_supported=False, cpu_count=64,
                          gpu_name="Tesla V100")


def make_config(tmp_path, base: str = "cpu_2proc.yaml", **changes) -> str:
    """A copy of a shipped config with some keys changed (None deletes the key)."""
    config = yaml.safe_load((CONFIGS / base).read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}_{base}"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def levels(report: doctor.Report) -> list[str]:
    return [f.level for f in report.findings]


# ----------------------------------------------------------------------------- the shipped configs


def test_cpu_2proc_is_ready_on_a_machine_without_gpus():
    report = check_file(CPU_2PROC, CPU_ONLY)
    assert report.ok
    assert levels(report) == [NOTE]
    only(report, NOTE, "no GPU here", "2 process(es)", "CPU over gloo")
    assert report.commands == [f"accelerate launch --config_file {CPU_2PROC} train.py"]


@pytest.mark.parametrize(("name", "facts", "overrides"), [
    ("4gpu.yaml", FOUR_GPUS, {}),
    ("fsdp_4gpu.yaml", FOUR_GPUS, {}),
    ("1gpu_debug.yaml", ONE_GPU, {}),
    ("2node_8gpu.yaml", FOUR_GPUS, {"machine_rank": 0}),
    ("2node_8gpu.yaml", FOUR_GPUS, {"machine_rank": 1}),
])
def test_shipped_configs_are_clean_on_the_machines_they_are_for(name, facts, overrides):
    report = check_file(CONFIGS / name, facts, overrides=overrides)
    assert report.findings == [], report.render()


def test_multi_node_config_prints_one_launch_command_per_machine():
    report = check_file(CONFIGS / "2node_8gpu.yaml", FOUR_GPUS)
    assert report.commands == [
        f"accelerate launch --config_file {CONFIGS / '2node_8gpu.yaml'} --machine_rank {rank} train.py"
        f"   # on machine {rank}" for rank in (0, 1)]


def test_gpu_configs_on_this_cpu_machine_say_so():
    report = check_file(CONFIGS / "4gpu.yaml", CPU_ONLY)
    only(report, WARNING, "no GPU here", "4 process(es)", "2 core(s)")  # more processes than cores
    only(report, WARNING, "bf16 on CPU")
    report = check_file(CONFIGS / "fsdp_4gpu.yaml", CPU_ONLY)
    assert not report.ok
    only(report, ERROR, "FSDP needs GPUs", "MULTI_CPU")


# ----------------------------------------------------------------------------- GPUs against num_processes and gpu_ids


def test_more_processes_than_gpus(tmp_path):
    report = check_file(CONFIGS / "4gpu.yaml", MachineFacts(gpu_count=2, nccl_available=True, cpu_count=16))
    assert not report.ok
    finding = only(report, ERROR, "4 process(es)", "only 2 GPU(s)")
    assert "num_processes: 2" in finding.fix


def test_fewer_processes_than_gpus_leaves_gpus_idle(tmp_path):
    report = check_file(make_config(tmp_path, "4gpu.yaml", num_processes=2), FOUR_GPUS)
    assert report.ok
    only(report, WARNING, "2 process(es) for 4 GPU(s)", "2 stay idle")


def test_gpu_ids_naming_a_missing_device(tmp_path):
    report = check_file(make_config(tmp_path, "4gpu.yaml", gpu_ids="2,3,4,5"), FOUR_GPUS)
    assert not report.ok
    only(report, ERROR, "'2,3,4,5'", "lacks")


def test_gpu_ids_fewer_than_processes(tmp_path):
    report = check_file(make_config(tmp_path, "4gpu.yaml", gpu_ids="0,1"), FOUR_GPUS)
    only(report, ERROR, "4 process(es)", "only 2 GPU(s)")


def test_one_gpu_id_for_a_multi_gpu_launch(tmp_path):
    report = check_file(make_config(tmp_path, "4gpu.yaml", gpu_ids="0", num_processes=1), FOUR_GPUS)
    only(report, ERROR, "fewer than two GPUs", "refuses")


def test_gpu_ids_written_as_a_yaml_number(tmp_path):
    report = check_file(make_config(tmp_path, "1gpu_debug.yaml", gpu_ids=0), ONE_GPU)
    finding = only(report, ERROR, "gpu_ids", "YAML number")
    assert "gpu_ids: '0'" in finding.fix


def test_gpu_ids_on_a_machine_without_gpus(tmp_path):
    report = check_file(make_config(tmp_path, gpu_ids="0,1"), CPU_ONLY)
    assert not report.ok
    only(report, ERROR, "'0,1'", "has none")


# ----------------------------------------------------------------------------- NCCL and precision


def test_nccl_missing_with_several_gpu_processes():
    facts = MachineFacts(gpu_count=4, nccl_available=False, cpu_count=32)
    report = check_file(CONFIGS / "4gpu.yaml", facts)
    assert not report.ok
    only(report, ERROR, "no NCCL")
    assert check_file(CONFIGS / "1gpu_debug.yaml", facts).ok  # one process needs no all-reduce


def test_bf16_on_gpus_without_bf16(tmp_path):
    report = check_file(make_config(tmp_path, "4gpu.yaml", num_processes=8), EIGHT_V100)
    assert not report.ok
    finding = only(report, ERROR, "bf16", "Tesla V100")
    assert "fp16" in finding.fix
    assert check_file(make_config(tmp_path, "4gpu.yaml", num_processes=8, mixed_precision="fp16"), EIGHT_V100).ok


def test_fp16_on_cpu_would_silently_train_in_fp32(tmp_path):
    report = check_file(make_config(tmp_path, mixed_precision="fp16"), CPU_ONLY)
    assert not report.ok
    only(report, ERROR, "fp16 on CPU", "fp32")


def test_bf16_on_cpu_is_only_a_warning(tmp_path):
    report = check_file(make_config(tmp_path, mixed_precision="bf16"), CPU_ONLY)
    assert report.ok
    only(report, WARNING, "bf16 on CPU", "without bf16 units")


def test_bf16_on_a_cpu_with_bf16_units_is_a_note(tmp_path):
    amx = MachineFacts(gpu_count=0, nccl_available=False, cpu_count=2, cpu_bf16=True)
    report = check_file(make_config(tmp_path, mixed_precision="bf16"), amx)
    assert report.ok and WARNING not in levels(report)
    only(report, NOTE, "bf16 on CPU", "AMX")


@pytest.mark.parametrize("flags, expected", [
    ("fpu sse2 avx2 avx512f avx512_bf16 amx_tile", True), ("fpu avx512f amx_bf16 amx_tile", True),
    ("fpu sse2 avx2 avx512f avx512_vnni", False)])
def test_cpu_bf16_units_are_read_from_the_cpu_flags(flags, expected):
    cpuinfo = f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n"
    assert cpu_has_bf16_units(cpuinfo) is expected
    assert cpu_has_bf16_units("") is False  # no /proc/cpuinfo: the cautious answer


def test_unknown_mixed_precision(tmp_path):
    only(check_file(make_config(tmp_path, mixed_precision="fp32"), CPU_ONLY), ERROR, "'fp32' is unknown")


# ----------------------------------------------------------------------------- the silent single-process traps


def test_multi_cpu_without_mpirun(tmp_path):
    report = check_file(make_config(tmp_path, distributed_type="MULTI_CPU"), CPU_ONLY)
    assert not report.ok
    finding = only(report, ERROR, "MULTI_CPU without mpirun", "1 process, not 2")
    assert "MULTI_GPU" in finding.fix


def test_cpu_flag_with_several_processes():
    report = check_file(CPU_2PROC, CPU_ONLY, cpu=True)
    assert not report.ok
    only(report, ERROR, "--cpu", "1 process, not 2")
    assert report.commands == [f"accelerate launch --config_file {CPU_2PROC} train.py"]  # the fixed command


def test_distributed_type_no_with_several_processes(tmp_path):
    report = check_file(make_config(tmp_path, distributed_type="NO"), CPU_ONLY)
    only(report, ERROR, "distributed_type NO", "1 process, not 2")


def test_multi_gpu_without_gpus_is_a_note_not_a_failure():
    report = check_file(CPU_2PROC, CPU_ONLY)
    assert report.ok and levels(report) == [NOTE]


def test_use_cpu_is_ignored_by_multi_gpu_launches(tmp_path):
    report = check_file(make_config(tmp_path, "4gpu.yaml", use_cpu=True), FOUR_GPUS)
    assert report.ok
    only(report, WARNING, "use_cpu: true is ignored")


def test_missing_num_processes(tmp_path):
    path = make_config(tmp_path, num_processes=None)
    only(check_file(path, CPU_ONLY), ERROR, "num_processes is not set")
    assert check_file(path, CPU_ONLY, overrides={"num_processes": 2}).ok


# ----------------------------------------------------------------------------- several machines


def test_num_processes_given_per_machine_instead_of_in_total(tmp_path):
    report = check_file(CONFIGS / "2node_8gpu.yaml", EIGHT_GPUS)  # 8 in total = 4 per 8-GPU machine
    assert not report.ok
    finding = only(report, ERROR, "4 per machine", "8 GPUs")
    assert "total over all machines" in finding.fix and "16" in finding.fix


def test_num_processes_not_divisible_by_machines(tmp_path):
    report = check_file(make_config(tmp_path, "2node_8gpu.yaml", num_processes=7), FOUR_GPUS)
    only(report, ERROR, "does not split evenly")


def test_machine_rank_out_of_range():
    report = check_file(CONFIGS / "2node_8gpu.yaml", FOUR_GPUS, overrides={"machine_rank": 2})
    only(report, ERROR, "machine_rank 2", "0..1")


def test_loopback_address_for_two_machines_warns():
    report = check_file(CONFIGS / "2node_8gpu.yaml", FOUR_GPUS, overrides={"main_process_ip": "127.0.0.1"})
    assert report.ok
    only(report, WARNING, "loopback")


@pytest.mark.parametrize("address", ["10.0.0.256", "192.168.1", "http://10.0.0.1", "10.0.0.1:29500",
                                     "node 001", "-node", "10.0.0.1/24"])
def test_malformed_main_process_ip(tmp_path, address):
    report = check_file(make_config(tmp_path, "2node_8gpu.yaml", main_process_ip=address), FOUR_GPUS)
    assert not report.ok
    only(report, ERROR, "main_process_ip", "malformed")


@pytest.mark.parametrize("address", ["10.0.0.1", "node001", "gpu-07.cluster.example.org", "fd00::1"])
def test_well_formed_main_process_ip(tmp_path, address):
    report = check_file(make_config(tmp_path, "2node_8gpu.yaml", main_process_ip=address), FOUR_GPUS)
    assert report.findings == [], report.render()


def test_multi_node_without_main_process_ip(tmp_path):
    report = check_file(make_config(tmp_path, "2node_8gpu.yaml", main_process_ip=None), FOUR_GPUS)
    only(report, ERROR, "main_process_ip is not set")


# ----------------------------------------------------------------------------- the port (a real listening socket)


@pytest.fixture
def busy_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_port_in_use_on_one_machine_is_a_warning(tmp_path, busy_port):
    report = diagnose(make_config(tmp_path, main_process_port=busy_port), CPU_ONLY)
    assert report.ok
    only(report, WARNING, f"port {busy_port} is already in use")


def test_port_in_use_on_machine_0_of_several_is_an_error(tmp_path, busy_port):
    path = make_config(tmp_path, "2node_8gpu.yaml", main_process_port=busy_port)
    report = diagnose(path, FOUR_GPUS, overrides={"machine_rank": 0})
    assert not report.ok
    only(report, ERROR, f"port {busy_port}", "machine 0 must listen")
    # machine 1 only connects to machine 0's port: nothing to check locally
    assert diagnose(path, FOUR_GPUS, overrides={"machine_rank": 1}).findings == []


def test_port_zero_over_several_machines(tmp_path):
    report = check_file(make_config(tmp_path, "2node_8gpu.yaml", main_process_port=0), FOUR_GPUS)
    only(report, ERROR, "main_process_port 0")


# ----------------------------------------------------------------------------- CLI and exit codes


def test_cli_exit_codes_and_output(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(MachineFacts, "detect", classmethod(lambda cls: CPU_ONLY))
    monkeypatch.setattr(doctor, "port_in_use", never_in_use)  # a job of someone else's on 29511 is no finding here
    assert cli.main(["doctor", "--config_file", str(CPU_2PROC)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"accel-ddp doctor: {CPU_2PROC} (given with --config_file)"
    assert "ready: 0 error(s), 0 warning(s), 1 note(s)" in out
    assert f"accelerate launch --config_file {CPU_2PROC} train.py" in out

    broken = make_config(tmp_path, distributed_type="MULTI_CPU")
    assert cli.main(["doctor", "--config_file", broken, "--main_process_port", "29999"]) == 1
    out = capsys.readouterr().out
    assert "will not run as intended: 1 error(s)" in out
    assert f"accelerate launch --config_file {broken} --main_process_port 29999 train.py" in out


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    ("distributed_type: [unclosed\n", "not valid YAML"),
    ("distributed_type: MULTI_GPU\nnum_gpus: 4\n", "Accelerate cannot load it"),
    ("distributed_type: MULTI_GUP\n", "Accelerate cannot load it"),
])
def test_unreadable_config_exits_2_with_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_text(content)
    assert doctor.run(doctor.build_parser().parse_args(["--config_file", str(path)]), facts=CPU_ONLY) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_versions_that_matter_are_on_one_line(monkeypatch, capsys):
    import accelerate
    import datasets
    import torch

    import accel_ddp

    monkeypatch.setattr(MachineFacts, "detect", classmethod(lambda cls: CPU_ONLY))
    assert cli.main(["doctor", "--config_file", str(CPU_2PROC)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  software: ")]
    from importlib.metadata import version

    for expected in (f"python {sys.version.split()[0]}", f"torch {torch.__version__} (",
                     f"accelerate {accelerate.__version__}", f"datasets {datasets.__version__}",
                     f"transformers {version('transformers')}", f"accel_ddp {accel_ddp.__version__}"):
        assert expected in line, (expected, line)
    cuda = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    assert cuda in line


CPU_INDEX_LINE = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def test_a_cuda_torch_on_a_machine_without_a_gpu_is_a_warning_with_its_size_and_the_cpu_install_line():
    """Issue 51 item 6: PyPI's torch is the CUDA build; on a machine without a GPU its CUDA libraries are gigabytes
    of nothing. The facts are faked: the build (torch.version.cuda), the driver, the libraries' size."""
    cuda_torch = MachineFacts(gpu_count=0, cpu_count=2, torch_version="2.14.1+cu130", cuda_build="13.0",
                              cuda_libraries_bytes=5_538_789_032)
    found = only(check_file(CPU_2PROC, cuda_torch), WARNING, "CUDA build")
    assert found.problem == ("torch 2.14.1+cu130 is a CUDA build (CUDA 13.0) on a machine without a GPU: it and its "
                             "CUDA libraries (nvidia-*, triton) take 5.5 GB here, which training on the CPU never uses")
    assert CPU_INDEX_LINE in found.fix
    for machine in (CPU_ONLY,  # a CPU-only torch
                    MachineFacts(gpu_count=1, nccl_available=True, cuda_build="13.0", torch_version="2.14.1+cu130"),
                    MachineFacts(cuda_build="13.0", nvidia_driver=True),  # GPUs hidden (CUDA_VISIBLE_DEVICES='')
                    MachineFacts(cuda_build="13.0", unusable_gpus=2)):  # a driver too old: its own error
        assert not [f for f in check_file(CPU_2PROC, machine).findings if "CUDA build" in f.line()], machine


def test_a_library_that_is_not_installed_says_so(monkeypatch):
    from importlib import metadata

    real = metadata.version

    def version(name):
        if name == "transformers":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    assert software_versions()["transformers"] == "not installed"


# ----------------------------------------------------------------------------- no --config_file: the launcher's file


@pytest.fixture
def default_config(tmp_path, monkeypatch):
    """Accelerate's default config path (its constant, computed from HF_HOME at import), moved into tmp_path."""
    from accelerate.commands.config import config_args

    path = tmp_path / "hf_home" / "accelerate" / "default_config.yaml"
    monkeypatch.setattr(config_args, "default_config_file", str(path))
    return path


def test_without_config_file_the_default_config_is_checked(default_config):
    default_config.parent.mkdir(parents=True)
    default_config.write_text((CONFIGS / "cpu_2proc.yaml").read_text())
    report = check_file(None, CPU_ONLY)
    assert report.source.path == str(default_config)
    first = report.render().splitlines()[0]
    assert first.startswith(f"accel-ddp doctor: {default_config} (Accelerate's default config")
    assert report.findings == check_file(CPU_2PROC, CPU_ONLY).findings  # the same file, the same findings
    assert report.commands == ["accelerate launch train.py"]  # it is read without --config_file


def test_without_any_config_a_launch_runs_one_process(default_config):
    report = check_file(None, CPU_ONLY)
    first = report.render().splitlines()[0]
    assert first.startswith("accel-ddp doctor: no config file") and str(default_config) in first
    assert report.ok and "NO, 1 process(es)" in report.summary
    finding = only(report, WARNING, "no accelerate config", "starts 1 process")
    assert "accelerate config" in finding.fix and "docs/launch.md" in finding.fix
    assert report.commands == ["accelerate launch train.py"]
    # With several GPUs `accelerate launch` starts one process per GPU by itself.
    report = check_file(None, FOUR_GPUS)
    assert report.ok and "MULTI_GPU, 4 process(es)" in report.summary
    only(report, NOTE, "one process per GPU (4, DDP)")


def test_cpu_flag_makes_the_launcher_ignore_the_default_config(default_config):
    default_config.parent.mkdir(parents=True)
    default_config.write_text((CONFIGS / "cpu_2proc.yaml").read_text())
    report = check_file(None, CPU_ONLY, cpu=True)
    assert report.source.path is None and "--cpu" in report.source.origin
    assert report.commands == ["accelerate launch --cpu train.py"]


def test_an_unreadable_default_config_is_named(default_config, capsys):
    default_config.parent.mkdir(parents=True)
    default_config.write_text("distributed_type: [unclosed\n")
    assert doctor.run(doctor.build_parser().parse_args([]), facts=CPU_ONLY) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"accel-ddp doctor: error: default config {default_config}: not valid YAML at line 2; fix the " \
                  "file's syntax"


@pytest.mark.slow
def test_python_m_accel_ddp_doctor_on_this_machine(tmp_path):
    """A real process: Accelerate finds its default config through HF_HOME, and so does the doctor."""
    import torch

    default = tmp_path / "accelerate" / "default_config.yaml"
    default.parent.mkdir()
    default.write_text(CPU_2PROC.read_text())
    result = subprocess.run([sys.executable, "-m", "accel_ddp", "doctor"],
                            capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO), "HF_HOME": str(tmp_path)})
    gpus = torch.cuda.device_count()
    assert result.returncode == (1 if gpus == 1 else 0), result.stdout + result.stderr  # 1 GPU < 2 processes
    assert result.stdout.splitlines()[0].startswith(f"accel-ddp doctor: {default} (Accelerate's default config")
    assert f"machine:  {gpus} GPU(s)" in result.stdout
    assert f"torch {torch.__version__}" in result.stdout
    assert "  accelerate launch train.py" in result.stdout


# ----------------------------------------------------------------------------- `accelerate config`, then launch

# The answers docs/launch.md gives, in the order `accelerate config` (Accelerate 1.15) asks them, on a
# machine with or without GPUs. An int picks a menu entry (0 = the first), a string is typed.
THIS_MACHINE = ("In which compute environment are you running?", 0)
MULTI_GPU = ("Which type of machine are you using?", 4)  # "multi-GPU", also for several CPU processes
_MULTI_GPU_QUESTIONS = [("Should distributed operations be checked", "no"), ("torch dynamo", "no"),
                        ("DeepSpeed", "no"), ("FullyShardedDataParallel", "no"), ("Megatron-LM", "no")]


# Accelerate 1.15 asks "What GPU(s) (by id) ...?"; 1.16 names the machine's devices: "What CPU(s) (by id) ...?"
# where there is no GPU. The same question, answered the same way.
WHICH_DEVICES = "(by id) should be used for training on this machine"


def _multi_gpu(processes: str, mixed_precision: int, machines: list[tuple] = (("How many different machines", "1"),)):
    return [THIS_MACHINE, MULTI_GPU, *machines, *_MULTI_GPU_QUESTIONS, ("How many GPU(s)", processes),
            (WHICH_DEVICES, "all"), ("numa efficiency", "no"), ("mixed precision", mixed_precision)]


ANSWERS = {  # shipped file -> answers
    "4gpu.yaml": _multi_gpu("4", 2),  # mixed precision: 0 no, 1 fp16, 2 bf16
    "1gpu_debug.yaml": [THIS_MACHINE, ("Which type of machine are you using?", 0), ("CPU only", "no"),
                        ("torch dynamo", "no"), ("DeepSpeed", "no"), (WHICH_DEVICES, "0"),
                        ("numa efficiency", "no"), ("mixed precision", 2)],
    "cpu_2proc.yaml": _multi_gpu("2", 0),
    "2node_8gpu.yaml": _multi_gpu("8", 2, [("How many different machines", "2"), ("rank of this machine", 0),
                                           ("IP address", "10.0.0.1"), ("port", "29513"),
                                           ("same local network", "yes")]),
}
# Where the written file differs from the shipped one, and why that changes nothing (docs/launch.md says so).
DIFFERENCES = {
    "4gpu.yaml": {"main_process_ip", "main_process_port"},  # unset: torchrun's 127.0.0.1, port 29500 or a free one
    "1gpu_debug.yaml": {"same_network"},  # read only for several machines
    "cpu_2proc.yaml": {"main_process_ip", "main_process_port"},
    "2node_8gpu.yaml": set(),
}
MULTI_CPU_TRAP = [THIS_MACHINE, ("Which type of machine are you using?", 1), ("How many different machines", "1"),
                  ("Should distributed operations be checked", "no"), ("launch mpirun", "no"), ("torch dynamo", "no"),
                  ("How many processes", "2"), ("mixed precision", 0)]


def answer_accelerate_config(answers: list[tuple], command: list[str], env: dict[str, str]) -> None:
    """Answer `accelerate config`'s questions as a user at a terminal would (a pty, number keys and Enter)."""
    import pexpect

    child = pexpect.spawn(command[0], command[1:], env=env, encoding="utf-8", timeout=120)
    for prompt, answer in answers:
        child.expect_exact(prompt)
        if isinstance(answer, int):  # a menu: wait until it reads raw keys (it hides the cursor), then pick
            child.expect_exact("\x1b[?25l")
            child.delaybeforesend = 0.05  # pexpect's default: the menu's tty.setraw (TCSAFLUSH) must come first
            child.send(f"{answer}\r")
        else:
            child.delaybeforesend = None  # input() reads from the moment its prompt is out
            child.sendline(answer)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before


CONFIG_COMMAND = """
import sys
from argparse import Namespace
from accelerate.commands.config.config import config_command  # what `accelerate config --config_file PATH` runs
for path in sys.argv[1:]:
    config_command(Namespace(config_file=path))
"""


@pytest.mark.slow
def test_accelerate_config_as_the_docs_answer_it_then_accelerate_launch_trains_digits_to_95_percent(tmp_path):
    """The docs' answers give the shipped configs; and the usual Accelerate workflow, where `accelerate config`
    writes the default config in HF_HOME and `accelerate launch` reads it; and the README's main run (no flags but
    the output folder, on cpu_2proc's answers) trains digits to 95% on two ranks.

    Two questionnaires run at once: one interpreter answers the four docs questionnaires and the multi-CPU trap's
    (one `accelerate config` run each would cost 5 starts; the trap's goes to HF_HOME's default path by name), and
    the real `accelerate config` writes the multi-GPU default config (cpu_2proc's answers) where HF_HOME puts it.
    Then both launches run at once: the multi-GPU one starts the package as a module (`accelerate launch -m
    accel_ddp train`), the one launch that shows this workflow, the module entry point and the default run's
    accuracy (test_ddp.py runs plain python; the written config differs from cpu_2proc.yaml only in
    DIFFERENCES, which change nothing).
    """
    written = {name: tmp_path / name for name in ANSWERS}
    homes = {"multi-CPU": tmp_path / "hf_multi_cpu", "multi-GPU": tmp_path / "hf_multi_gpu"}
    trap_default = homes["multi-CPU"] / "accelerate" / "default_config.yaml"
    trap_default.parent.mkdir(parents=True)  # what `accelerate config` does for its default path
    accelerate_config = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "config"]
    sessions = [
        ([pair for answers in ANSWERS.values() for pair in answers] + MULTI_CPU_TRAP,
         [sys.executable, "-c", CONFIG_COMMAND, *map(str, written.values()), str(trap_default)], dict(os.environ)),
        (ANSWERS["cpu_2proc.yaml"], accelerate_config, {**os.environ, "HF_HOME": str(homes["multi-GPU"])}),
    ]
    with ThreadPoolExecutor(len(sessions)) as pool:
        list(pool.map(lambda session: answer_accelerate_config(*session), sessions))

    for name, path in written.items():
        got, shipped = load_launch_config(str(path)), load_launch_config(str(CONFIGS / name))
        differs = {key for key in got.keys() | shipped.keys() if got.get(key) != shipped.get(key)}
        assert differs == DIFFERENCES[name], (name, {key: (got.get(key), shipped.get(key)) for key in differs})
    for home in homes.values():
        assert (home / "accelerate" / "default_config.yaml").is_file()

    outs = {answers: tmp_path / f"out_{answers}" for answers in homes}
    tiny = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--epochs", "1",
            "--global_batch_size", "16"]  # refused before training: any run
    trapped, multi_gpu = launch_together(
        {"script_args": [*tiny, "--output_dir", str(outs["multi-CPU"])], "config_file": None,
         "env": {"HF_HOME": str(homes["multi-CPU"])}},
        {"script_args": ["train", "--output_dir", str(outs["multi-GPU"])], "script": "accel_ddp",
         "launch_args": ["-m"], "config_file": None, "env": {"HF_HOME": str(homes["multi-GPU"])}})

    # multi-CPU: Accelerate's simple launcher, one process, refused before training
    assert trapped.returncode != 0
    lines = [line for line in trapped.stderr.splitlines() if line.startswith("accel_ddp: error:")]
    assert len(lines) == 1, trapped.stderr[-3000:]
    assert lines[0].startswith("accel_ddp: error: accelerate launch started 1 process, but its config asks for "
                               "several (distributed_type MULTI_CPU without mpirun")
    assert "returned non-zero exit status 2" in trapped.stderr  # the launcher names the worker's exit code
    assert not outs["multi-CPU"].exists()
    # multi-GPU: torchrun, two ranks of a gloo group trained the default run to the README's accuracy
    assert multi_gpu.returncode == 0, multi_gpu.stderr[-3000:]
    summary = read_summary(outs["multi-GPU"])
    assert summary["world_size"] == 2 and summary["eval_samples"] == 360
    assert summary["eval_accuracy"] >= 0.95, multi_gpu.stdout[-2000:]


# ----------------------------------------------------------------------------- the traps are real


PROBE = """
import os, torch
from accelerate import PartialState
from accel_ddp.distributed.world import single_process_trap
trapped = single_process_trap() is not None  # what train.py checks before it joins a group
state = PartialState(cpu=not torch.cuda.is_available())
print(f"PROBE world={state.num_processes} rank={state.process_index} trapped={trapped}", flush=True)
"""


# `accelerate launch ARGS` is `launch_command(launch_command_parser().parse_args(ARGS))` (accelerate/commands/launch.py,
# main): one interpreter makes the four launches one after the other, each from its own arguments, as four
# `accelerate launch` commands would (the launcher's environment for a worker is a copy of os.environ made per launch,
# prepare_simple_launcher_cmd_env; torchrun's is patched in and restored, multi_gpu_launcher). The traps go first, so
# that nothing the torchrun launch might leave could reach them.
LAUNCHES = """
import json, subprocess, sys
from accelerate.commands.launch import launch_command, launch_command_parser
for argv in json.loads(sys.argv[1]):
    try:
        launch_command(launch_command_parser().parse_args(argv))
        code = 0
    except subprocess.CalledProcessError as error:
        code = error.returncode
    except SystemExit as error:
        code = error.code
    print(f"LAUNCHED {code}", flush=True)  # every worker of this launch has ended: its output is above
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="launch behaviour checked on Linux")
def test_the_traps_the_doctor_flags_really_start_one_process(tmp_path):
    """...and train.py refuses each of them, from what the launcher leaves in the environment."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    cases = {
        "MULTI_CPU": ([], make_config(tmp_path, distributed_type="MULTI_CPU")),
        "NO": ([], make_config(tmp_path, distributed_type="NO")),
        "--cpu": (["--cpu"], make_config(tmp_path)),
        "ok": ([], make_config(tmp_path)),
    }
    launches = [["--config_file", path, "--num_processes", "2", "--main_process_port", str(free_port()), *flags,
                 str(probe)] for flags, path in cases.values()]
    result = check(subprocess.run([sys.executable, "-c", LAUNCHES, json.dumps(launches)], env=suite_env(),
                                  capture_output=True, text=True, timeout=560, cwd=REPO))  # 4 launches in turn
    outputs = result.stdout.split("LAUNCHED ")
    assert len(outputs) == len(cases) + 1, result.stdout
    for (name, (flags, path)), before, after in zip(cases.items(), outputs, outputs[1:], strict=False):
        assert after.startswith("0\n"), (name, result.stdout, result.stderr[-3000:])  # the launch's exit code
        # Two ranks share the pipe and a print's text and newline are separate writes: match, don't split lines.
        worlds = re.findall(r"PROBE world=\d+ rank=\d+ trapped=(?:True|False)", before)
        expected = 2 if name == "ok" else 1
        assert len(worlds) == expected and all(f"world={expected}" in w for w in worlds), (name, result.stdout)
        assert all(w.endswith(f"trapped={name != 'ok'}") for w in worlds), (name, worlds)
        report = diagnose(path, CPU_ONLY, cpu=bool(flags), is_port_in_use=never_in_use)
        assert report.ok == (name == "ok"), report.render()
