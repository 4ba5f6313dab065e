"""accel_ddp.util.messages: the one format of a warning, note and error line, and which rank prints it (the rank
rule of accel_ddp.util.ranks)."""

from __future__ import annotations

import pytest

from accel_ddp.util.messages import error_line, first_line, note, prints, say, warn, write
from accel_ddp.util.ranks import RANK_VARS, WORLD_SIZE_VARS, launch_rank, launch_world_size


def test_first_line_is_the_first_stripped_line_cut_to_its_limit():
    assert first_line(ValueError("\n  bad value\nmore detail")) == "bad value"
    assert first_line(KeyError()) == "KeyError"  # says nothing: its type
    assert first_line(ValueError("x" * 400)) == "x" * 300
    assert first_line(ValueError("x" * 400), 10, "...") == "x" * 7 + "..."
    assert first_line(ValueError("short"), 10, "...") == "short"


def test_lines_have_the_one_format(capsys):
    warn("--foo is deprecated")
    note("padding with <eos>")
    err = capsys.readouterr().err
    assert err == "accel_ddp: warning: --foo is deprecated\naccel_ddp: note: padding with <eos>\n"
    assert error_line("--lr -1: must be > 0; pass a positive number") == \
        "accel_ddp: error: --lr -1: must be > 0; pass a positive number\n"
    say("resumed from step 4")
    say("preempted", err=True)
    warn("above the bar", above_bar=True)
    out = capsys.readouterr()
    assert out.out == "accel_ddp: resumed from step 4\n"
    assert out.err == "accel_ddp: preempted\naccel_ddp: warning: above the bar\n"


class _Stream:
    """A console stream that keeps each ``write`` call apart."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.writes.append("<flush>")


def test_write_puts_text_as_it_is_in_one_write_then_flushes(monkeypatch):
    """``write``: no prefix, the line and its end in one write call (another process's output cannot land between
    them), on stdout or stderr; ``end=""`` for a report that brings its own newlines."""
    out, err = _Stream(), _Stream()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    write("step 4 epoch 0: eval_loss 0.5000 (8 samples)")
    write("accel_ddp: error: --lr must be > 0\n", err=True, end="")
    assert out.writes == ["step 4 epoch 0: eval_loss 0.5000 (8 samples)\n", "<flush>"]
    assert err.writes == ["accel_ddp: error: --lr must be > 0\n", "<flush>"]


def test_write_above_the_bar_goes_through_tqdm(capsys):
    """``above_bar``: the line still reaches stdout whole (tqdm.write clears a bar's line first)."""
    from tqdm.auto import tqdm

    with tqdm(total=3, disable=True):
        write("step 2 epoch 0: loss 0.1000 lr 0.001", above_bar=True)
    assert capsys.readouterr().out == "step 2 epoch 0: loss 0.1000 lr 0.001\n"


@pytest.mark.parametrize(("rank", "printed"), [(None, True), ("0", True), ("1", False)])
def test_first_rank_messages_print_once_per_launch(monkeypatch, capsys, rank, printed):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    warn("seen once", ranks="first")
    assert (capsys.readouterr().err == "accel_ddp: warning: seen once\n") is printed
    assert prints("every")


def test_an_unknown_rank_rule_is_a_bug_not_silence():
    with pytest.raises(ValueError, match="ranks must be"):
        prints("all")


@pytest.mark.parametrize(("env", "rank", "world"), [
    ({}, 0, 1), ({"RANK": "3", "WORLD_SIZE": "4"}, 3, 4),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, 1, 2),  # an MPI launch: the names Accelerate reads after torchrun's
    ({"RANK": "", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8"}, 2, 8),  # an empty RANK is no rank
])
def test_the_rank_rule_reads_the_launchers_variables(monkeypatch, capsys, env, rank, world):
    for name in RANK_VARS + WORLD_SIZE_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (launch_rank(), launch_world_size()) == (rank, world)
    say("once", ranks="first")
    assert capsys.readouterr().out == ("accel_ddp: once\n" if rank == 0 else "")
