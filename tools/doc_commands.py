"""Check every shell command of README.md and docs/*.md as a reader would run them, in order, on a fresh clone.

    python tools/doc_commands.py          # list each command with what it is, then the problems (exit 1 if any)

Commands are the lines of ``bash`` fences (``\\`` continuations joined, ``&&`` split, comments dropped) and the
``$ `` lines of unlabelled fences (a transcript: the lines after it are its output). Pages are read in the
order of the README's documentation table. Without running anything, each command is checked:

- every flag exists: training flags with accel_ddp's own parser (``accel_ddp/cli/args.py``, which also checks
  the values), launch flags with Accelerate's (``accelerate launch``, ``accel-ddp launch``), ``accel-ddp`` commands
  with theirs; no deprecated spelling;
- every file it names exists in the repository (launch configs, ``--model_config``, scripts, ``pkg.module:name``
  of a user function), or is made by an earlier command (under its ``--output_dir``, or an example's ``--out``);
- a block runs on its own: data an example command makes (seconds) is made in each block that reads it, and a model
  another block trains is named (its ``--output_dir``) in the comment of the command that reads it;
- every training command has an ``--output_dir`` of its own (``outputs/run`` when it gives none). A command that
  continues an earlier run on purpose (a resume, the second machine of one run, the same run shown again) says
  ``same --output_dir`` in its shell comment, on its line or the comment lines just above it.

An HTML comment on the line before a fence marks a block that is not to be followed as written:

- ``<!-- doc-commands: listing -->``: a file's contents or what a run writes, not commands (nothing checked);
- ``<!-- doc-commands: your-files -->``: commands naming the reader's own files, modules or Hub data (flags and
  output folders checked; the files not).

A transcript whose output shows an ``accel_ddp: error:`` line is a refusal: it writes nothing, so its output
folder is no one's. tests/test_doc_commands.py runs this check and the commands that take seconds.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAME_RUN = "same --output_dir"
MARKER = re.compile(r"^<!--\s*doc-commands:\s*([\w-]+)\s*-->$")
_FENCE = re.compile(r"^\s*```\s*(\w*)")
SHELLS = ("bash", "sh", "shell", "console")
# Flags whose value is a path in the repository or one made by an earlier command.
PATH_FLAGS = ("config", "data_dir", "model_config", "init_from", "resume_from_checkpoint")
# Flags whose value is a path when it looks like one (else a Hub id or a registry name).
MAYBE_PATH_FLAGS = ("model", "tokenizer", "model_name_or_path", "tokenizer_name")
LOCAL = re.compile(r"^(\.{0,2}/|outputs/|data/|examples/|accelerate_configs/|tests/)|\.(json|ya?ml|csv|parquet)$")
USER_FUNCTION = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_]\w*)$")
# Scripts that train with an output folder of their own: path -> its default --output_dir.
SCRIPT_OUTPUT_DIRS = {"examples/custom_model_and_data.py": "outputs/custom_example",
                      "examples/optimizers.py": "outputs/own_optimizer"}


@dataclasses.dataclass
class Command:
    page: str  # relative to the repository
    line: int
    argv: list[str]  # without the leading NAME=value environment assignments
    env: dict[str, str]
    comment: str  # its own shell comment and the comment lines just above it
    marker: str | None  # the fence's doc-commands marker
    output: list[str]  # a transcript's output lines
    block: int = 0  # the line of its fence: the commands a reader copies together
    kind: str = ""  # what it is: train, launch, accel-ddp, example, ...
    output_dir: str | None = None  # a training command's folder
    makes: list[str] = dataclasses.field(default_factory=list)  # paths it creates (output folder, --out)
    train_args: list[str] | None = None  # what reaches accel_ddp's parser

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def text(self) -> str:
        return shlex.join([*(f"{k}={v}" for k, v in self.env.items()), *self.argv])

    @property
    def refused(self) -> bool:
        """A transcript that shows accel_ddp refusing it (so it writes nothing)."""
        return any(line.startswith("accel_ddp: error:") for line in self.output)


def pages() -> list[Path]:
    """README.md, then docs/*.md in the order of the README's links to them (any others after)."""
    readme = REPO / "README.md"
    linked = dict.fromkeys(re.findall(r"\]\(docs/([\w.-]+\.md)\)", readme.read_text(encoding="utf-8")))
    found = [REPO / "docs" / name for name in linked if (REPO / "docs" / name).is_file()]
    return [readme, *found, *sorted(set((REPO / "docs").glob("*.md")) - set(found))]


def commands(paths: list[Path] | None = None) -> list[Command]:
    """Every command of the pages, in reading order."""
    return [cmd for path in (paths or pages()) for cmd in _page_commands(path)]


def _page_commands(path: Path) -> list[Command]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Command] = []
    number = 0
    while number < len(lines):
        fence = _FENCE.match(lines[number])
        number += 1
        if not fence:
            continue
        before = next((line.strip() for line in reversed(lines[:number - 1]) if line.strip()), "")
        marker = MARKER.match(before)
        end = next((i for i in range(number, len(lines)) if _FENCE.match(lines[i])), len(lines))
        block = list(enumerate(lines[number:end], start=number + 1))
        number = end + 1
        if marker and marker.group(1) == "listing":
            continue
        page = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
        if fence.group(1) in SHELLS:
            cmds = _shell_block(page, block, marker and marker.group(1))
        elif not fence.group(1):
            cmds = _transcripts(page, block, marker and marker.group(1))
        else:
            cmds = []
        for cmd in cmds:
            cmd.block = number - len(block) - 1
        found += cmds
    return found


def _shell_block(page: str, block: list[tuple[int, str]], marker: str | None) -> list[Command]:
    found, comments, pending, start = [], [], "", 0
    for number, line in block:
        if not pending and line.strip().startswith("#"):
            comments.append(line.strip())
            continue
        if not line.strip():
            comments = []
            continue
        pending, start = (pending + " " + line.strip() if pending else line.strip()), start or number
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        found += _split(page, start, pending, " ".join(comments), marker, [])
        pending, comments, start = "", [], 0
    return found


def _transcripts(page: str, block: list[tuple[int, str]], marker: str | None) -> list[Command]:
    found = []
    starts = [i for i, (_, line) in enumerate(block) if line.startswith("$ ")]
    for i, at in enumerate(starts):
        output = [line for _, line in block[at + 1:starts[i + 1] if i + 1 < len(starts) else len(block)]]
        number, line = block[at]
        found += _split(page, number, line[2:], "", marker, output)
    return found


def _split(page: str, number: int, line: str, above: str, marker: str | None, output: list[str]) -> list[Command]:
    """One shell line as its commands (split at ``&&`` and ``;``), the comment kept with each."""
    comment = line.partition(" #")[2] if " #" in line else ""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    parts: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", ";"):
            parts.append([])
        else:
            parts[-1].append(token)
    found = []
    for tokens in filter(None, parts):
        env = {}
        while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):
            key, _, value = tokens.pop(0).partition("=")
            env[key] = value
        found.append(Command(page, number, tokens, env, f"{above} {comment}".strip(), marker, output))
    return found


# ----------------------------------------------------------------------------- what each command is


def classify(cmd: Command) -> list[str]:
    """Fill in ``kind``, ``train_args``, ``output_dir`` and ``makes``; return the flag and syntax problems."""
    argv = cmd.argv
    if argv[:2] in (["accelerate", "launch"], ["accel-ddp", "launch"]):  # the same arguments (accel_ddp/cli/launch.py)
        return _launch(cmd)
    if argv[:2] == ["accelerate", "config"]:
        cmd.kind = "accelerate config"
        return []
    if argv[:1] == ["python"] and argv[1:3] == ["-m", "accel_ddp"] or argv[:1] == ["accel-ddp"]:
        return _accel_ddp(cmd, argv[3:] if argv[0] == "python" else argv[1:])
    if argv[:3] == ["python", "-m", "pytest"]:
        cmd.kind = "pytest"
        return []
    if argv[:1] == ["python"] and len(argv) > 1:
        return _script(cmd, argv[1], argv[2:])
    if argv[:1] == ["train.py"]:
        return [f"`{cmd.text}` is no command; write `python train.py ...`"]
    if argv[:1] == ["sbatch"]:
        return _sbatch(cmd)
    if argv[:1] == ["bash"]:
        cmd.kind = "bash script"
        return _exists(argv[1] if len(argv) > 1 else "", "the script")
    if argv[:1] in (["pip"], ["git"], ["cd"], ["tensorboard"]):
        cmd.kind = argv[0]
        return []
    return [f"unknown program {argv[0]!r}: teach tools/doc_commands.py what it is"]


def _sbatch(cmd: Command) -> list[str]:
    """``sbatch [OPTIONS] SCRIPT [TRAIN FLAGS]``: the script passes its arguments on to train.py."""
    script = next((a for a in cmd.argv[1:] if a.endswith((".sbatch", ".sh"))), "")
    problems = _exists(script, "the sbatch script")
    if not script:
        return problems
    problems += _train(cmd, cmd.argv[cmd.argv.index(script) + 1:])
    cmd.kind = "sbatch"
    if "--output_dir" not in " ".join(cmd.train_args or []):  # then a folder per job: outputs/<job name>-<job id>
        cmd.output_dir, cmd.makes = None, []
    return problems


def _launch(cmd: Command) -> list[str]:
    from accelerate.commands.launch import launch_command_parser

    try:
        args = _quiet_parse(launch_command_parser(), cmd.argv[2:])
    except SystemExit:
        return [f"accelerate launch refuses its flags: {cmd.text}"]
    problems = _exists(args.config_file, "--config_file") if args.config_file else []
    if args.module:
        command = args.training_script_args[:1]
        if args.training_script == "accel_ddp" and command in (["evaluate"], ["predict"]):
            return problems + _accel_ddp(cmd, args.training_script_args)
        if args.training_script != "accel_ddp" or command != ["train"]:
            return [*problems, f"`-m {args.training_script}` is not `-m accel_ddp train`, evaluate or predict"]
        return problems + _train(cmd, args.training_script_args[1:])
    return problems + _script(cmd, args.training_script, args.training_script_args)


def _quiet_parse(parser, argv: list[str]):
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()):
        return parser.parse_args(argv)


def _script(cmd: Command, script: str, args: list[str]) -> list[str]:
    if script == "train.py":
        return _train(cmd, args)
    if script.startswith("benchmarks/"):  # a measurement: its figures are quoted beside it
        cmd.kind = "benchmark"
        return _exists(script, "the script")
    cmd.kind = "example"
    problems = _exists(script, "the script")
    if "--out" in args[:-1]:
        cmd.makes.append(args[args.index("--out") + 1])
    if script in SCRIPT_OUTPUT_DIRS:
        given = args[args.index("--output_dir") + 1] if "--output_dir" in args[:-1] else None
        cmd.kind, cmd.output_dir = "train script", given or SCRIPT_OUTPUT_DIRS[script]
        cmd.makes.append(cmd.output_dir)
    return problems


def _train(cmd: Command, args: list[str]) -> list[str]:
    from accel_ddp.cli.args import parse_args
    from accel_ddp.config import RENAMED_FLAGS
    from accel_ddp.util.validation import ConfigError

    cmd.kind, cmd.train_args = "train", args
    old = [a for a in args if a.startswith("--") and a[2:].partition("=")[0] in RENAMED_FLAGS]
    problems = [f"deprecated flag {old[0]}; write --{RENAMED_FLAGS[old[0][2:]]}"] if old else []
    try:
        cfg = parse_args(args)
    except ConfigError as err:  # a transcript showing this very refusal shows it on purpose
        shown = f"accel_ddp: error: {err}" in cmd.output
        return problems if shown else [*problems, f"accel_ddp refuses it: {err}"]
    cmd.output_dir = cfg.output_dir
    cmd.makes.append(cfg.output_dir)
    return problems


def _accel_ddp(cmd: Command, args: list[str]) -> list[str]:
    if args[:1] == ["train"]:
        return _train(cmd, args[1:])
    from accel_ddp.cli.commands import build_parser

    cmd.kind = f"accel-ddp {args[0] if args else ''}".strip()
    try:
        parsed = _quiet_parse(build_parser(), args)
    except SystemExit:
        return [f"accel-ddp refuses its arguments: {cmd.text}"]
    if getattr(parsed, "out", None) and cmd.kind in ("accel-ddp evaluate", "accel-ddp predict"):
        cmd.makes.append(parsed.out)
    config_file = getattr(parsed, "config_file", None)
    return _exists(config_file, "--config_file") if config_file else []


def _exists(path: str, what: str) -> list[str]:
    return [] if path and (REPO / path).exists() else [f"{what} {path!r} is not in the repository"]


def _extras(cmd: Command) -> list[str]:
    """``pip install -e ".[test]"``: each extra is one of setup.cfg's."""
    import configparser

    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg", encoding="utf-8")
    known = set(parser["options.extras_require"]) if parser.has_section("options.extras_require") else set()
    named = [x.strip() for arg in cmd.argv for group in re.findall(r"^\.\[([^\]]*)\]$", arg) for x in group.split(",")]
    return [f"pip extra {x!r} is not in setup.cfg" for x in named if x not in known]


# ----------------------------------------------------------------------------- the checks across commands


def _values(args: list[str]) -> list[tuple[str, str]]:
    """(flag name, value) pairs of a command line's ``--flag value`` and ``--flag=value``."""
    pairs = []
    for i, arg in enumerate(args):
        if arg.startswith("--") and "=" in arg:
            name, _, value = arg[2:].partition("=")
            pairs.append((name, value))
        elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((arg[2:], args[i + 1]))
    return pairs


def _made(path: str, made: list[str]) -> bool:
    clean = path.rstrip("/")
    return (REPO / clean).exists() or any(clean == m or clean.startswith(m.rstrip("/") + "/") for m in made)


def _named_files(cmd: Command, made: list[str]) -> list[str]:
    """The paths and user functions a command names exist, in the repository or made by an earlier command."""
    problems = []
    for name, value in _values(cmd.train_args or []):
        if USER_FUNCTION.match(value):
            problems += _user_function(value)
        elif (name in PATH_FLAGS and value != "auto" or name in MAYBE_PATH_FLAGS and LOCAL.search(value)) \
                and not _made(value, made):
            problems.append(f"--{name} {value}: neither in the repository nor made by an earlier command")
    if cmd.kind in ("accel-ddp evaluate", "accel-ddp predict"):  # the run (or checkpoint) follows the command
        argv = cmd.argv
        folder = argv[argv.index(cmd.kind.split()[1]) + 1]
        if not _made(folder, made):
            problems.append(f"{folder}: no earlier command writes it")
    if cmd.kind in ("accel-ddp plot", "accel-ddp summary", "tensorboard"):
        folder = cmd.argv[-1] if cmd.kind != "tensorboard" else dict(_values(cmd.argv)).get("logdir", "")
        if not _made(folder, made):
            problems.append(f"{folder}: no earlier command writes it")
    return problems


def _user_function(ref: str) -> list[str]:
    module, name = USER_FUNCTION.match(ref).groups()
    base = REPO / module.replace(".", "/")
    source = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
    if source is None:
        return [f"{ref}: no module {module} in the repository"]
    if not re.search(rf"^(def|class) {name}\b|^{name}\s*=", source.read_text(encoding="utf-8"), re.M):
        return [f"{ref}: {source.relative_to(REPO)} defines no {name}"]
    return []


def _own_folder(cmd: Command, owners: dict[str, Command]) -> list[str]:
    """A training command's --output_dir is its own, unless its comment says it continues an earlier run."""
    if cmd.output_dir is None or cmd.refused:
        return []
    folder, same = cmd.output_dir.rstrip("/"), SAME_RUN in cmd.comment
    owner = owners.setdefault(folder, cmd)
    if owner is not cmd and not same:
        return [f"--output_dir {folder} is also that of {owner.where}: give it its own --output_dir (or say "
                f"`{SAME_RUN}` in its comment when it continues that run)"]
    if owner is cmd and same:
        return [f"its comment says `{SAME_RUN}`, but no earlier command writes {folder}"]
    return []


def _own_inputs(cmd: Command, makers: dict[str, Command]) -> list[str]:
    """A block runs on its own: the data a command reads that an example command makes (seconds) is made in its own
    block too, and a model another block's run trains (minutes) is named in its comment (that run's folder), so that
    a reader who copies one block (the LoRA example alone) has what it needs or is told what to run first."""
    problems = []
    for name, value in _values(cmd.train_args or []):
        maker = next((m for path, m in makers.items() if value.rstrip("/") == path or value.startswith(path + "/")),
                     None)
        if name == "output_dir" or maker is None or (maker.page, maker.block) == (cmd.page, cmd.block):
            continue
        if maker.kind == "example":
            problems.append(f"--{name} {value} is made in another block ({maker.where}): add `{maker.text}` to this "
                            "block (seconds), so that it runs on its own")
        elif maker.output_dir and maker.output_dir not in cmd.comment:
            problems.append(f"--{name} {value} is trained by another block ({maker.where}): name "
                            f"{maker.output_dir} in this command's comment, with what to run first")
    return problems


def check(cmds: list[Command] | None = None) -> list[str]:
    """Every problem of the commands (classified in place), one line each, naming page, line and command."""
    cmds = commands() if cmds is None else cmds
    problems, made, owners, makers = [], [], {}, {}
    for cmd in cmds:
        found = classify(cmd) if cmd.argv else ["an empty command"]
        found += _extras(cmd) if cmd.kind == "pip" else []
        found += [] if cmd.marker == "your-files" else _named_files(cmd, made) + _own_inputs(cmd, makers)
        found += _own_folder(cmd, owners)
        problems += [f"{cmd.where}: {problem}  [{cmd.text}]" for problem in found]
        made += cmd.makes
        makers.update({path.rstrip("/"): cmd for path in cmd.makes})
    return problems


def main(argv: list[str] | None = None) -> int:
    del argv
    cmds = commands()
    problems = check(cmds)
    for cmd in cmds:
        folder = f" -> {cmd.output_dir}" if cmd.output_dir else ""
        print(f"{cmd.where:28} {cmd.kind:18} {cmd.text}{folder}")
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(cmds)} commands, {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))  # accel_ddp from this checkout
    sys.exit(main())
