"""The docs stay true to the code: the generated flag table is current, every relative link and
anchor resolves, the README stays a door, one name per concept."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from accel_ddp.config import RENAMED_FLAGS, RENAMED_VALUES, TrainConfig, sections
from accel_ddp.config.dependents import DEPENDENTS
from tools import check_links, flag_table

REPO = Path(__file__).resolve().parents[1]


def test_committed_flag_table_matches_train_config():
    page = flag_table.FLAGS_PAGE.read_text(encoding="utf-8")
    assert flag_table.render(page) == page, (
        f"docs/flags.md is out of date with TrainConfig; regenerate it with `{flag_table.REGENERATE}`")


def test_flag_table_has_every_field_once_with_its_default_and_help_under_its_section():
    table = flag_table.table()
    options, dependents = table.split("\n### Flags that need another\n")  # the second: a row per dependent flag
    for f in dataclasses.fields(TrainConfig):
        rows = [line for line in options.splitlines() if line.startswith(f"| `--{f.name}` |")]
        assert len(rows) == 1, f.name
        assert f.metadata["help"].replace("|", "\\|") in rows[0]
    for row in DEPENDENTS:
        assert len([line for line in dependents.splitlines() if line.startswith(f"| `--{row.flag}` |")]) == 1
    assert "| `--lr` | `0.003` |" in table
    assert "| `--synthetic_shape` | `1 28 28` |" in table
    assert "| `--per_device_batch_size` | unset |" in table
    assert "| `--ddp_gradient_as_bucket_view` | `true` |" in table
    headings = re.findall(r"^### (.+)$", table, re.M)
    assert headings == ["Data", "Model", "Fine-tuning", "Task", "Optimisation", "Evaluation, logging, outputs",
                        "Performance and distributed knobs", "Flags that need another", "Hugging Face names",
                        "Old spellings"]
    grouped = {section.title: section.fields for section in sections()}  # --help's groups too
    assert [f.name for f in grouped["Model"]] == ["model", "hidden_size", "width", "model_config"]
    for old, new in RENAMED_FLAGS.items():
        assert f"| `--{old}` | `--{new}` |" in table
    for (flag, old), new in RENAMED_VALUES.items():
        assert f"| `--{flag} {old}` | `--{flag} {new}` |" in table


def test_check_fails_on_a_stale_table_and_names_the_command(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "flags.md"
    page = flag_table.FLAGS_PAGE.read_text(encoding="utf-8")
    stale.write_text(page.replace("| `--lr` | `0.003` |", "| `--lr` | `0.1` |"), encoding="utf-8")
    monkeypatch.setattr(flag_table, "FLAGS_PAGE", stale)
    monkeypatch.setattr(flag_table, "REPO", tmp_path)
    assert flag_table.main(["--check"]) == 1
    assert "python tools/flag_table.py --write" in capsys.readouterr().err
    assert flag_table.main(["--write"]) == 0
    assert flag_table.main(["--check"]) == 0
    assert stale.read_text(encoding="utf-8") == page


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    pages = check_links.pages()
    assert REPO / "README.md" in pages and REPO / "docs" / "flags.md" in pages
    problems = [p for page in pages for p in check_links.broken_links(page)]
    assert not problems, "broken links (check with `python tools/check_links.py`):\n" + "\n".join(problems)


def test_link_checker_reports_missing_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `--loader` flag (device)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md) [ok](other.md#the---loader-flag-device) [ok](other.md#twice-1) [ok](#page)\n"
        "[web](https://example.com/missing.md) `[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [bad local](#nope)\n"
    )
    problems = check_links.broken_links(page)
    assert len(problems) == 3, problems
    assert "page.md:8: missing.md: no such file or folder" in problems[0]
    assert "other.md#nope: no heading with anchor #nope" in problems[1]
    assert "#nope: no heading with anchor #nope in" in problems[2]


def test_readme_is_a_door_of_at_most_200_lines_linking_every_docs_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_the_device_loader_has_one_name_in_the_docs():
    """The old "fast" spelling appears only in the generated table of deprecated spellings."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    old = re.compile(r"fast[ _-]?loader|fast path|in-memory fast|--loader fast", re.I)
    for page in pages:
        text = page.read_text(encoding="utf-8")
        if page.name == "flags.md":
            text = flag_table.render(text).replace(flag_table.table(), "")
        found = old.search(text)
        assert not found, f"{page.relative_to(REPO)}: {found.group(0)!r}; call it the device loader"
