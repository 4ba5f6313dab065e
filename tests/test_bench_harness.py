"""benchmarks/common.py's harness, the pieces every benchmark script shares (issue 52 item 7): the shared options,
the order of variants per round, ratios, the results file and a variant run in fresh interpreters."""

from __future__ import annotations

import json

import pytest


def test_the_shared_options_mean_the_same_in_every_script_and_each_script_keeps_its_own_default_and_help():
    from benchmarks.common import parser

    p = parser("What X costs per step.\n\nMore.", steps=10, rounds=(3, "turns of every variant"), threads=None)
    assert p.description == "What X costs per step."
    args = p.parse_args([])
    assert (args.steps, args.rounds, args.threads) == (10, 3, None)
    assert p.parse_args(["--steps", "2", "--threads", "4"]).threads == 4
    helps = {a.dest: a.help for a in p._actions}
    assert helps["rounds"] == "turns of every variant" and "OMP_NUM_THREADS" in helps["threads"]
    with pytest.raises(KeyError):
        parser("doc", not_a_shared_option=1)  # a script's own option is its own add_argument


def test_variants_take_turns_going_first():
    from benchmarks.common import alternated, rotated

    assert [alternated(("bare", "accel"), k) for k in range(3)] == [["bare", "accel"], ["accel", "bare"],
                                                                   ["bare", "accel"]]
    assert [rotated(["a", "b", "c"], k) for k in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                               ["a", "b", "c"]]
    assert alternated({"before": 1, "fused": 2}, 1) == ["fused", "before"]  # a dict's keys, as cpu_kernels.py has


def test_a_ratio_is_a_dash_where_a_side_is_missing():
    from benchmarks.common import ratio

    assert ratio(3.0, 2.0) == "1.50" and ratio(1.0, 8.0, ".1%") == "12.5%"
    assert ratio(None, 2.0) == ratio(1.0, 0) == ratio(float("nan"), 1.0) == "-"


def test_tax_and_peers_rate_the_epochs_after_the_first_one_way():
    from benchmarks.common import epoch_rates
    from benchmarks.peers import rates
    from benchmarks.tax import per_step

    epochs = [{"steps": 10, "seconds": 9.0, "cpu_seconds": 9.0},  # the first: one-time costs, left out
              {"steps": 10, "seconds": 2.0, "cpu_seconds": 1.0}, {"steps": 10, "seconds": 3.0, "cpu_seconds": 2.0}]
    assert per_step(epochs) == {"steps_per_sec": 4.0, "cpu_ms_per_step": 150.0}
    assert rates(epochs, 64) == {"samples_per_sec": 256.0, "cpu_ms_per_step": 150.0, "steps_per_epoch": 10}
    assert epoch_rates(epochs[:1])["steps_per_sec"] == 10 / 9.0  # one epoch only: it counts


def test_a_dry_runs_machine_is_read_without_importing_torch():
    import subprocess
    import sys

    from tests.helpers.runs import REPO

    code = ("import sys; from benchmarks.common import machine_info; m = machine_info(gpu=False); "
            "print('torch' in sys.modules, m['gpu'], bool(m['torch']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "None", "True"], done.stderr


def test_the_results_file_is_written_whole_and_said(tmp_path, capsys):
    from benchmarks.common import write_json

    path = write_json(tmp_path / "out" / "r.json", {"x": 1, "path": tmp_path})
    assert json.loads(path.read_text()) == {"x": 1, "path": str(tmp_path)}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left beside it
    assert f"wrote {path}" in capsys.readouterr().out


def test_run_fresh_returns_each_copys_last_line_and_exits_with_the_output_of_a_failed_one(tmp_path):
    from benchmarks.common import run_fresh

    script = tmp_path / "side.py"
    script.write_text("import json, os, sys\nprint('noise')\nprint(json.dumps({'pid': os.getpid()}))\n"
                      "sys.exit(int(sys.argv[1]))\n")
    answers = run_fresh([script, "0"], copies=2)
    assert len(answers) == 2 and answers[0]["pid"] != answers[1]["pid"]  # two interpreters, at once
    with pytest.raises(SystemExit) as failed:
        run_fresh([script, "3"])
    assert f"{script} 3 failed (3)" in str(failed.value) and "noise" in str(failed.value)
