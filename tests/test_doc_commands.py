"""Every command of README.md and docs/ runs as written, in order, on a fresh clone (tools/doc_commands.py):
checked without running (flags, files, an --output_dir of its own), and the ones that take seconds run here."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys

import pytest

from accel_ddp.cli import commands as cli
from tests.helpers.runs import REPO, main_ranks, suite_env
from tools import doc_commands

# Why each kind of command is not run here; a new kind of command must be placed here or in the runs below.
NOT_RUN = {
    "train": "it trains: seconds to hours, on GPUs or the Hub for most (the README's main run is launched by "
             "tests/cli/test_doctor.py::test_accelerate_config_as_the_docs_answer_it_then_accelerate_launch_trains_"
             "digits_to_95_percent)",
    "train script": "it trains (examples/custom_model_and_data.py: tests/data/test_loaders.py trains its functions; "
                    "examples/optimizers.py: tests/optim/test_user.py builds its optimizer and schedule)",
    "sbatch": "needs SLURM",
    "pip": "installs packages", "git": "clones", "cd": "",
    "pytest": "the suite itself",
    "bash script": "benchmarks/gpu_first_minutes.sh: minutes, for a GPU machine (its dry run: test_gpu_first_minutes)",
    "benchmark": "a measurement (benchmarks/*.py): minutes of training",
    "tensorboard": "a server, after a run",
    "accelerate config": "interactive",
    "accel-ddp plot": "needs an earlier command's finished run (tests/tracking/test_report.py plots one)",
    "accel-ddp summary": "needs an earlier command's finished run (tests/tracking/test_report.py reads one)",
    "accel-ddp evaluate": "needs an earlier command's finished run (tests/test_inference.py evaluates several)",
    "accel-ddp predict": "needs an earlier command's finished run (tests/test_inference.py predicts with several)",
}
RUN_HERE = ("accel-ddp doctor", "example", "refused train")


def kind(cmd: doc_commands.Command) -> str:
    return "refused train" if cmd.kind == "train" and cmd.refused else cmd.kind


@pytest.fixture(scope="module", autouse=True)
def _cuda_libraries_measured_once():
    """The doctor sizes torch's CUDA packages on a CPU-only machine (cli/machine.py cuda_libraries_bytes: every
    installed distribution's metadata and ~80k files stat'ed, ~0.4 s of CPU a call); the same machine gives the same
    figure to each of this module's six doctor runs: measured by the first, for real, and kept."""
    from accel_ddp.cli import machine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(machine, "cuda_libraries_bytes", functools.cache(machine.cuda_libraries_bytes))
        yield


@pytest.fixture(scope="module")
def doc_check() -> tuple[list[doc_commands.Command], list[str]]:
    """Every doc command, checked once for the module (~0.6 s a check): the commands, classified, and the problems."""
    cmds = doc_commands.commands()
    problems = doc_commands.check(cmds)  # classifies them
    return cmds, problems


@pytest.fixture(scope="module")
def doc_cmds(doc_check) -> list[doc_commands.Command]:
    return doc_check[0]


def test_every_doc_command_uses_real_flags_and_files_and_an_output_dir_of_its_own(doc_check):
    doc_cmds, problems = doc_check
    assert not problems, "run `python tools/doc_commands.py`:\n" + "\n".join(problems)
    texts = [c.text for c in doc_cmds]
    assert "accel-ddp launch --config_file accelerate_configs/cpu_2proc.yaml train.py" in texts
    folders = [c.output_dir for c in doc_cmds if c.output_dir and not c.refused]
    assert len(folders) > 25 and "outputs/elastic-demo" in folders
    assert not [c.where for c in doc_cmds if kind(c) not in NOT_RUN and kind(c) not in RUN_HERE]


def write_page(tmp_path, text: str):
    page = tmp_path / "page.md"
    page.write_text(text)
    return doc_commands.check(doc_commands.commands([page]))


def test_evaluate_and_predict_need_a_run_an_earlier_command_wrote(tmp_path):
    problems = write_page(tmp_path, """# Page

```bash
python train.py --output_dir outputs/a
accel-ddp evaluate outputs/a/checkpoints/step_00000010 --out outputs/a.json
accelerate launch --config_file accelerate_configs/cpu_2proc.yaml -m accel_ddp predict outputs/b --out outputs/b.jsonl
python -m accel_ddp evaluate outputs/a --no_such_flag
```
""")
    assert len(problems) == 2, "\n".join(problems)
    assert ":6: outputs/b: no earlier command writes it" in problems[0]
    assert ":7: accel-ddp refuses its arguments" in problems[1]


def test_the_checker_names_each_kind_of_problem(tmp_path):
    problems = write_page(tmp_path, """# Page

```bash
python train.py --output_dir outputs/a
python train.py --lerning_rate 0.1 --output_dir outputs/b       # a typo
python train.py --output_dir outputs/a                           # the same folder, unsaid
# resumes it (same --output_dir)
python train.py --output_dir outputs/a --resume_from_checkpoint auto
python train.py --output_dir outputs/c  # same --output_dir, but of no one
accelerate launch --config_file accelerate_configs/nowhere.yaml train.py --output_dir outputs/d \\
    --init_from outputs/a/model.safetensors --data_dir data/missing
train.py --output_dir outputs/e
python train.py --model examples.custom_model_and_data:build_nothing --output_dir outputs/f
python train.py ... --output_dir outputs/g
accel-ddp plot outputs/never
accel-ddp plot outputs/a
python train.py --fast_loader_max_mb 10 --output_dir outputs/h
frobnicate --now
```

<!-- doc-commands: listing -->
```bash
python train.py --no_such_flag
```

<!-- doc-commands: your-files -->
```bash
python train.py --data_dir my_data --model my_pkg.models:build --output_dir outputs/i
```

```
$ python train.py --global_batch_size 30 --per_device_batch_size 4
accel_ddp: error: --global_batch_size 30 is not divisible by ...
```
""")
    expected = [
        ":5: accel_ddp refuses it: unknown flag --lerning_rate; did you mean --learning_rate (= --lr)?",
        ":6: --output_dir outputs/a is also that of",
        ":9: its comment says `same --output_dir`, but no earlier command writes outputs/c",
        ":10: --config_file 'accelerate_configs/nowhere.yaml' is not in the repository",
        ":10: --data_dir data/missing: neither in the repository nor made by an earlier command",
        ":12: `train.py --output_dir outputs/e` is no command; write `python train.py ...`",
        ":13: examples.custom_model_and_data:build_nothing: examples/custom_model_and_data.py defines no build_nothing",
        ":14: accel_ddp refuses it: unrecognized arguments: ...",
        ":15: outputs/never: no earlier command writes it",
        ":17: deprecated flag --fast_loader_max_mb; write --device_loader_max_mb",
        ":18: unknown program 'frobnicate'",
    ]
    assert len(problems) == len(expected), "\n".join(problems)
    for problem, start in zip(problems, expected, strict=True):
        assert start in problem, (start, problem)
    assert all(problem.startswith(f"{tmp_path / 'page.md'}:") for problem in problems)


def test_a_block_that_reads_another_block_s_data_or_model_says_so(tmp_path):
    """Issue 51: tasks.md's LoRA block read the classification example's data, made in another block: copied alone,
    it failed. Data an example makes (seconds) is made in each block that reads it; a model another block trains is
    named in the reading command's comment."""
    problems = write_page(tmp_path, """# Page

```bash
python examples/pydoc_text.py topics --out data/pydoc_topics
python train.py --dataset hf --data_dir data/pydoc_topics --output_dir outputs/a
```

```bash
python train.py --dataset hf --data_dir data/pydoc_topics --output_dir outputs/b
python train.py --init_from outputs/a/model.safetensors --output_dir outputs/c
# from outputs/a (the block above: run it first)
python train.py --init_from outputs/a/model.safetensors --output_dir outputs/d
```
""")
    assert len(problems) == 2, "\n".join(problems)
    assert ":9: --data_dir data/pydoc_topics is made in another block (" in problems[0]
    assert "add `python examples/pydoc_text.py topics --out data/pydoc_topics` to this block" in problems[0]
    assert ":10: --init_from outputs/a/model.safetensors is trained by another block (" in problems[1]
    assert "name outputs/a in this command's comment" in problems[1]


def test_the_doctor_commands_run_as_written(doc_cmds, capsys):
    doctors = [c for c in doc_cmds if c.kind == "accel-ddp doctor"]
    assert len(doctors) >= 4
    for cmd in doctors:
        argv = cmd.argv[3:] if cmd.argv[0] == "python" else cmd.argv[1:]
        code = cli.main(argv)
        out = capsys.readouterr().out
        assert code in (0, 1), (cmd.where, out)  # ready, or not ready on this machine: a verdict, not a failure
        assert out.startswith("accel-ddp doctor: ") and "launch with" in out, (cmd.where, out)


MULTI_CPU_ANSWERS = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
mixed_precision: 'no'
num_machines: 1
num_processes: 2
machine_rank: 0
use_cpu: true
"""


def test_the_doctor_transcript_is_what_the_doctor_prints_for_that_config(doc_cmds, tmp_path, monkeypatch, capsys):
    """launch.md's `$ accel-ddp doctor` after answering multi-CPU to `accelerate config`: the same lines, but the
    machine's own (its GPUs and cores, the versions and platform, a CUDA torch without a GPU and the warnings'
    count it adds to)."""
    from accelerate.commands.config import config_args

    (shown,) = [c for c in doc_cmds if c.kind == "accel-ddp doctor" and c.output]
    default = shown.output[0].split()[2]  # the path in its first line: Accelerate's default config
    (tmp_path / "default_config.yaml").write_text(MULTI_CPU_ANSWERS)
    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "default_config.yaml"))
    assert cli.main(shown.argv[1:]) == 1  # will not run as intended
    printed = capsys.readouterr().out.replace(str(tmp_path / "default_config.yaml"), default).splitlines()
    own = ("  machine:", "  software:", "WARNING  torch ")

    def common(lines: list[str]) -> list[str]:
        return [re.sub(r"\d+ warning\(s\)", "N warning(s)", line) for line in lines if not line.startswith(own)]
    assert common(printed) == common(shown.output), shown.where


def test_the_refusals_shown_in_the_docs_are_the_ones_a_run_prints(doc_cmds, tmp_path, monkeypatch, capfd):
    refusals = [c for c in doc_cmds if kind(c) == "refused train" and c.argv[:2] == ["python", "train.py"]]
    assert refusals
    monkeypatch.chdir(tmp_path)  # as written, from a clone: nothing of the repository is needed
    for cmd in refusals:
        capfd.readouterr()
        assert main_ranks(cmd.train_args, world_size=1) == [2], cmd.where
        shown = [line for line in cmd.output if line.startswith("accel_ddp: error:")]
        assert capfd.readouterr().err.strip().splitlines() == shown, cmd.where
    assert not list(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs the nlp extra (tokenizers)")
def test_the_example_data_commands_run_as_written_and_make_what_their_comment_says(doc_cmds, tmp_path):
    examples = {c.text: c for c in doc_cmds if c.kind == "example"}  # the README repeats one of tasks.md's
    assert len(examples) >= 2
    for text, cmd in examples.items():
        result = subprocess.run([sys.executable, str(REPO / cmd.argv[1]), *cmd.argv[2:]], cwd=tmp_path,
                                env=suite_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (text, result.stderr[-2000:])
        assert cmd.makes and all(any((tmp_path / made).glob("train.*")) for made in cmd.makes), text
        quoted = re.search(r"([\d,]+) training(?:,| and) (\d+) test paragraphs", cmd.comment)
        if quoted and sys.version_info[:2] == (3, 11):  # the figures quoted beside it, from Python 3.11's docs
            train, test = quoted.group(1).replace(",", ""), quoted.group(2)
            assert f": {train} training and {test} test paragraphs" in result.stdout, (cmd.where, result.stdout)
    assert sum(bool(re.search("training.* test paragraphs", c.comment)) for c in examples.values()) == 2
