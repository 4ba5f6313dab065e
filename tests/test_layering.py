"""The package's imports run one way (accel_ddp/__init__.py's picture): no module imports a layer above its own.

Read from the source with ast, lazy (in-function) imports included: an import moved into a function to dodge a
cycle is still an arrow.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "accel_ddp"
# Bottom first; a module may import its own group and the groups of lower layers only. "accel_ddp" is the
# package itself (its __init__: the public names, and __version__ for the doctor).
LAYERS = [
    {"util"}, {"config"}, {"lifecycle"}, {"outputs"}, {"tracking", "checkpoint"}, {"distributed"}, {"data"},
    {"tasks"},
    {"models", "optim", "transforms"},
    {"step", "evaluation", "auto_batch", "callbacks"},
    {"assemble", "bad_steps"}, {"after_step", "inference"}, {"loop"},
    {"cli", "accel_ddp"},
    {"__main__"},
]
LAYER = {group: number for number, groups in enumerate(LAYERS) for group in groups}
TESTS = ROOT.parent / "tests"


@functools.cache
def _parsed(text: str) -> tuple[ast.AST, ...]:
    """Every node of a module's syntax tree, in ``ast.walk``'s order, once per text: the checks and the planted copies
    (the package's files but one or two) read the same trees again, and parsing the package is ~0.5 s of CPU."""
    return tuple(ast.walk(ast.parse(text)))


def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """The nodes of the module at ``path`` (:func:`_parsed`); nothing here changes a node."""
    return _parsed(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module", autouse=True)
def _trees_dropped_after_this_module():
    """The cached trees go with this module's last test: kept, the worker's ranks forked later would walk their
    ~10^5 nodes at each garbage collection."""
    yield
    _parsed.cache_clear()


def _module(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "accel_ddp"


def _edges(root: Path = ROOT) -> set[tuple[str, str]]:
    modules = {_module(path, root): path for path in root.rglob("*.py")}
    return {(name, target) for name, path in modules.items() for target in _imports(path, name)
            if target in modules and target != name}


def _against(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return {(src, dst) for src, dst in edges if _group(src) != _group(dst) and LAYER[_group(src)] < LAYER[_group(dst)]}


def test_no_module_imports_a_layer_above_its_own():
    edges = _edges()
    assert ("accel_ddp.loop", "accel_ddp.assemble") in edges and len(edges) > 100  # the imports were read
    assert _against(edges) == set(), "arrows against the flow (see accel_ddp/__init__.py)"


def _planted(tmp_path: Path, appended: dict[str, str]) -> Path:
    """A copy of the package with ``appended``'s text at the end of each named file (created where absent)."""
    import shutil

    copy = tmp_path / "accel_ddp"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in appended.items():
        (copy / name).parent.mkdir(exist_ok=True)
        with open(copy / name, "a", encoding="utf-8") as fh:
            fh.write(text)
    return copy


def test_an_arrow_against_the_flow_is_found_lazy_or_relative(tmp_path):
    """The check itself: a copy of the package with three arrows planted against the flow (a lazy import in a
    function, a relative import, a plain one) reports exactly those three."""
    copy = _planted(tmp_path, {"util/atomic.py": "\n\ndef _planted():\n    from accel_ddp.loop import train  # noqa\n",
                               "config/layout.py": "\nfrom ..data import sampler  # noqa\n",
                               "optim/build.py": "\nimport accel_ddp.step  # noqa\n"})
    planted = {("accel_ddp.util.atomic", "accel_ddp.loop"), ("accel_ddp.config.layout", "accel_ddp.data"),
               ("accel_ddp.config.layout", "accel_ddp.data.sampler"), ("accel_ddp.optim.build", "accel_ddp.step")}
    assert _against(_edges(copy)) == planted


def _test_imports(tests: Path = TESTS) -> list[str]:
    """Test modules imported by a file of ``tests``: "path: name"."""
    found = []
    for path in tests.rglob("*.py"):
        for node in _nodes(path):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(tests)}: {name}" for name in names
                      if any(part.startswith("test_") for part in name.split("."))]
    return found


def test_no_test_module_imports_another(tmp_path):
    """Shared code lives in tests/helpers/; a test module names itself in a user-code string at most. Proven on a
    planted import."""
    assert _test_imports() == []
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test_a.py").write_text("from tests.data.test_b import shared  # noqa\n")
    assert _test_imports(tmp_path) == ["data/test_a.py: tests.data.test_b"]


def _unmirrored(tests: Path = TESTS) -> set[str]:
    """Folders of ``tests`` that are no subpackage of accel_ddp/ (nor helpers/, scripts/)."""
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    return folders - {"helpers", "scripts"} - {p.parent.name for p in ROOT.glob("*/__init__.py")}


def test_tests_mirror_the_package(tmp_path):
    """Every folder of tests/ is a subpackage of accel_ddp/ (or helpers/, scripts/); a planted one is found."""
    assert _unmirrored() == set()
    assert {"config", "data", "checkpoint", "distributed", "lifecycle", "cli", "tasks"} <= \
        {p.name for p in TESTS.iterdir() if p.is_dir()}
    for name in ("data", "helpers", "planted"):
        (tmp_path / name).mkdir()
    assert _unmirrored(tmp_path) == {"planted"}


def _ungrouped(edges: set[tuple[str, str]]) -> set[str]:
    return {_group(src) for src, _ in edges} - set(LAYER)


def test_every_group_has_a_layer(tmp_path):
    """Every module's group is in LAYERS; a planted subpackage that has none is found."""
    assert _ungrouped(_edges()) == set()
    copy = _planted(tmp_path, {"planted/__init__.py": "from accel_ddp.util import atomic  # noqa\n"})
    assert _ungrouped(_edges(copy)) == {"planted"}


def _unnamed(doc: str, modules: list[str]) -> list[str]:
    """The modules without a row of their own in a subpackage's docstring: a line that starts with ``name.py`` (or,
    as config/'s list, ``- ``name``:``)."""
    rows = {line.split()[0] for line in doc.splitlines() if line.strip()}
    rows |= {line.split("``")[1] + ".py" for line in doc.splitlines() if line.startswith("- ``")}
    return [name for name in modules if f"{name}.py" not in rows]


@pytest.mark.parametrize("package", sorted(p.parent.name for p in ROOT.glob("*/__init__.py")))
def test_each_subpackage_says_what_it_holds_and_what_it_may_import(package):
    doc = importlib.import_module(f"accel_ddp.{package}").__doc__ or ""
    assert "May import:" in doc, doc
    modules = sorted(m.stem for m in (ROOT / package).glob("*.py") if m.name != "__init__.py")
    assert _unnamed(doc, modules) == [], f"{package}/__init__.py has no row for these modules"


def test_a_module_whose_row_was_deleted_is_found_though_its_name_is_in_other_rows():
    """The check itself: checkpoint/__init__.py without start.py's row still says "start" elsewhere (agree_start,
    "where_to_start"); the module is reported all the same."""
    doc = importlib.import_module("accel_ddp.checkpoint").__doc__
    kept = "\n".join(line for line in doc.splitlines() if not line.lstrip().startswith("start.py"))
    assert "start" in kept and _unnamed(kept, ["start", "manager"]) == ["start"]


def _module_map() -> str:
    text = (ROOT.parent / "docs" / "development.md").read_text(encoding="utf-8")
    return text[text.index("## Module map"):text.index("### Who writes what")]


def _unmapped(table: str) -> list[str]:
    """The package's root modules and subpackages with no row of docs/development.md's module map naming them."""
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    names = [f"{p.stem}.py" for p in ROOT.glob("*.py") if not p.stem.startswith("__")]
    names += [f"accel_ddp/{p.parent.name}/" for p in ROOT.glob("*/__init__.py")]
    return sorted(name for name in names if not any(f"`{name}`" in row.split("|")[1] or
                                                     f"`accel_ddp/{name}`" in row.split("|")[1] for row in rows))


def test_the_module_map_of_development_md_has_a_row_for_every_module():
    assert _unmapped(_module_map()) == []


def test_a_module_without_its_map_row_is_found():
    table = _module_map()
    kept = "\n".join(line for line in table.splitlines() if not line.startswith(("| `accel_ddp/callbacks.py`",
                                                                                 "| `accel_ddp/transforms/`")))
    assert "callbacks" in kept and "transforms" in kept and _unmapped(kept) == ["accel_ddp/transforms/", "callbacks.py"]


def _cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """One import cycle among ``edges`` (its modules, the first repeated at the end), or None."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    if "accel_ddp" in graph:  # the package's own lazy names (train, exit_process) import upwards by design
        graph["accel_ddp"] = {dst for dst in graph["accel_ddp"] if not dst.startswith("accel_ddp.")
                              or _group(dst) in {"config", "util"}}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for target in sorted(graph.get(module, ())):
            if (found := visit(target, path + [module])) is not None:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        if (found := visit(module, [])) is not None:
            return found
    return None


def test_no_import_cycle_between_modules():
    assert _cycle(_edges()) is None


def test_a_planted_import_cycle_is_found(tmp_path):
    """The check itself: two modules of one layer importing each other (lazily, so Python itself would not stop it,
    and no arrow runs against the flow) are reported as a cycle."""
    copy = _planted(tmp_path, {
        "util/atomic.py": "\n\ndef _planted():\n    from accel_ddp.util import ranks  # noqa\n",
        "util/ranks.py": "\n\ndef _planted():\n    from accel_ddp.util.atomic import atomic_write_text  # noqa\n"})
    edges = _edges(copy)
    assert _against(edges) == set() and _cycle(_edges(ROOT)) is None
    assert _cycle(edges) in (["accel_ddp.util.atomic", "accel_ddp.util.ranks", "accel_ddp.util.atomic"],
                             ["accel_ddp.util.ranks", "accel_ddp.util.atomic", "accel_ddp.util.ranks"])


# Issue 52 item 2: each component takes its own typed section of the options (config/views.py) or explicit values.


def _naming_train_config(root: Path = ROOT) -> set[str]:
    """The package's modules, other than TrainConfig's homes (config/, cli/, assemble.py, loop.py and the package's
    __init__), whose text names it: code, annotations, docstrings and comments alike (``cfg: Any  # TrainConfig``
    hides nothing)."""
    named = set()
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(("config/", "cli/")) or relative in ("assemble.py", "loop.py", "__init__.py"):
            continue
        if re.search(r"\bTrainConfig\b", path.read_text(encoding="utf-8")):
            named.add(relative)
    return named


def test_train_config_is_named_only_in_config_cli_assemble_loop_and_the_package():
    assert _naming_train_config() == set(), "give the component a typed section (config/views.py)"


def test_a_module_that_names_train_config_is_found(tmp_path):
    """The check itself: planted in a parameter's annotation and in a comment beside an ``Any``, it is found; in
    config/, cli/ and the package's __init__ it is at home."""
    copy = _planted(tmp_path, {
        "data/resolve.py": "\n\ndef _planted(cfg: 'TrainConfig') -> None:  # noqa\n    pass\n",
        "models.py": "\n\ndef _planted(cfg: Any) -> None:  # noqa: the whole TrainConfig\n    pass\n",
        "cli/args.py": "\n# TrainConfig\n", "config/views.py": "\n# TrainConfig\n"})
    assert _naming_train_config(copy) == {"data/resolve.py", "models.py"}


# Sizes (docs/development.md, "Style"): a module past this many lines does two jobs, a function past 80 is two
# functions, and the package's root keeps the loop's story (the rest lives in subpackages).
MAX_MODULE_LINES = 420
MAX_FUNCTION_LINES = 80
MAX_ROOT_MODULES = 12


def _long_modules(root: Path = ROOT) -> dict[str, int]:
    """The package's modules over MAX_MODULE_LINES: path -> lines."""
    sizes = {str(path.relative_to(root)): len(path.read_text(encoding="utf-8").splitlines())
             for path in root.rglob("*.py")}
    return {path: lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES}


def _long_functions(root: Path = ROOT) -> dict[str, int]:
    """The package's functions and methods over MAX_FUNCTION_LINES (from ``def`` to their last line, docstring
    included; a nested function counts within its own and on its own): "path:line name" -> lines."""
    found = {}
    for path in root.rglob("*.py"):
        for node in _nodes(path):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{path.relative_to(root)}:{node.lineno} {node.name}"] = lines
    return found


def _crowded_root(root: Path = ROOT) -> list[str]:
    """The package's root modules where they are more than MAX_ROOT_MODULES (else [])."""
    modules = sorted(path.name for path in root.glob("*.py"))
    return modules if len(modules) > MAX_ROOT_MODULES else []


def test_no_module_is_over_420_lines_and_no_function_over_80():
    assert _long_modules() == {}, "split the module by job (docs/development.md's module map says where)"
    assert _long_functions() == {}, "a function past 80 lines is two functions"


def test_at_most_12_modules_at_the_package_root():
    assert (ROOT / "loop.py").is_file() and _crowded_root() == []


def test_a_planted_long_module_long_function_and_crowded_root_are_found(tmp_path):
    """The checks themselves: a module grown past 420 lines, a function of 81 lines and enough new root modules
    to make 13 are reported, and nothing else."""
    long_function = "\n\ndef _planted():\n" + "    x = 1\n" * MAX_FUNCTION_LINES  # def + 80: 81 lines
    extra = MAX_ROOT_MODULES + 1 - len(list(ROOT.glob("*.py")))
    copy = _planted(tmp_path, {"util/atomic.py": "# planted\n" * MAX_MODULE_LINES, "config/layout.py": long_function,
                               **{f"planted_{n}.py": "" for n in range(extra)}})
    lines = len((copy / "util" / "atomic.py").read_text(encoding="utf-8").splitlines())
    assert _long_modules(copy) == {"util/atomic.py": lines}
    assert [(name.split(":")[0], lines) for name, lines in _long_functions(copy).items()] == \
        [("config/layout.py", MAX_FUNCTION_LINES + 1)]
    assert len(_crowded_root(copy)) == MAX_ROOT_MODULES + 1 and "planted_0.py" in _crowded_root(copy)


def _private_names(nodes: tuple[ast.AST, ...]) -> set[str]:
    """The private names a module defines: its functions and classes, its module and class variables, and the
    attributes it sets on ``self`` or ``cls``."""
    names = set()
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node):
            names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.endswith("__")}


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _private_reaches(root: Path = ROOT) -> list[str]:
    """``thing._name`` (read, called or set) in one module, where ``_name`` is private to another module of the
    package and not its own, and ``from accel_ddp... import _name`` ("path:line text"); ``self._name`` and
    ``cls._name`` are the class's own. Third-party private names (torch's, Accelerate's) are not the package's, so
    not reported here."""
    parsed = {path: _nodes(path) for path in sorted(root.rglob("*.py"))}
    defined = {path: _private_names(nodes) for path, nodes in parsed.items()}
    found = []
    for path, nodes in parsed.items():
        elsewhere = set().union(*(names for other, names in defined.items() if other != path))
        found += [f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}" for node in nodes
                  if isinstance(node, ast.Attribute) and node.attr in elsewhere - defined[path] and not _on_self(node)]
        found += [f"{path.relative_to(root)}:{node.lineno} import {alias.name}" for node in nodes
                  if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accel_ddp")
                  for alias in node.names if alias.name.startswith("_") and not alias.name.endswith("__")]
    return sorted(found)


def test_no_module_reaches_into_another_modules_private_names():
    assert _private_reaches() == [], "give the name a public spelling in its module, or move the logic there"


def test_a_planted_reach_into_a_private_name_is_found(tmp_path):
    """The check itself: a call of the manager's private helper from another module, a private module function read
    through its module and a private name imported are reported; the module's own use of its private names is not."""
    copy = _planted(tmp_path, {
        "checkpoint/async_save.py": "\n\ndef _planted(manager):\n    return manager._writing\n",
        "outputs/trained.py": "\n\ndef _planted():\n    from accel_ddp.checkpoint import storage\n"
                              "    return storage._parsed(b'{}')\n",
        "data/hf.py": "\nfrom accel_ddp.data.hf_source import _PLANTED  # noqa\n"})
    found = [where.split(":")[0] + " " + where.split(" ", 1)[1] for where in _private_reaches(copy)]
    assert set(found) == {"checkpoint/async_save.py manager._writing",
                                                  "outputs/trained.py storage._parsed", "data/hf.py import _PLANTED"}


def _console_writes(root: Path = ROOT) -> list[str]:
    """Console writes outside util/messages.py ("path:line text"): ``print(...)``, ``sys.stdout.write`` /
    ``sys.stderr.write`` (``.flush`` alike does not count) and ``tqdm.write``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "util/messages.py":
            continue
        for node in _nodes(path):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name == "print" or name in ("sys.stdout.write", "sys.stderr.write", "tqdm.write"):
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    return found


def test_every_console_write_goes_through_messages():
    assert _console_writes() == [], "write through accel_ddp.util.messages (say, warn, note, write)"


def test_a_planted_console_write_is_found(tmp_path):
    """The check itself: a ``print`` in a subpackage's module and a ``sys.stderr.write`` at the root are reported;
    messages.py's own writes are not."""
    copy = _planted(tmp_path, {"outputs/trained.py": "\n\ndef _planted():\n    print('hello')\n",
                               "callbacks.py": "\n\ndef _planted():\n    import sys\n    sys.stderr.write('x')\n"})
    assert [where.split(":")[0] + " " + where.split(" ")[1] for where in _console_writes(copy)] == \
        ["callbacks.py sys.stderr.write", "outputs/trained.py print"]
