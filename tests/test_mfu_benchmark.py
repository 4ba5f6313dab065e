"""benchmarks/mfu.py runs its plumbing on the CPU (--dry-run): a tiny GPT-2 per variant, a results file; a variant
that fails, times out or cannot run here is recorded (its log kept) and the next one runs."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from types import SimpleNamespace

import pytest

from tests.helpers.multiproc import run_ranks

pytest.importorskip("transformers")


def _forked_children(monkeypatch) -> list[list[str]]:
    """mfu.py's children as processes forked from the test's: each variant's own command line (``python -m
    benchmarks.mfu --child VARIANT ...``, parsed by the same ``main``), environment and log, without a fresh
    interpreter importing torch and Transformers per variant. A fresh one matters for the GPU's measurements (no
    compile cache or allocator state shared), not for the plumbing; the real command starts one in
    test_gpu_first_minutes.py's dry run (its mfu stage). Returns the command lines, as they come."""
    from benchmarks import mfu

    started = []

    def popen(cmd, *, stdout, stderr, cwd, env, start_new_session):
        assert cmd[:4] == [sys.executable, "-m", "benchmarks.mfu", "--child"] and cwd == mfu.REPO, cmd
        assert stderr == mfu.subprocess.STDOUT and start_new_session
        started.append(cmd)

        def child() -> int:  # as the interpreter would: its output into the log, a traceback and exit 1 on error
            os.dup2(stdout.fileno(), 1)
            os.dup2(stdout.fileno(), 2)
            sys.stdout = sys.stderr = open(1, "w", closefd=False)  # noqa: SIM115 - the process's own
            try:
                return mfu.main(cmd[3:])
            except Exception:  # noqa: BLE001 - the traceback is the child's output
                traceback.print_exc()
                return 1
            finally:
                sys.stdout.flush()

        code = run_ranks(child, world_size=1, timeout=240, env=env)[0]
        return SimpleNamespace(pid=None, wait=lambda timeout: code)

    monkeypatch.setattr(mfu.subprocess, "Popen", popen)
    return started


@pytest.mark.slow
def test_mfu_dry_run_trains_each_variant_in_its_own_process_and_writes_the_results_file(tmp_path, capsys,
                                                                                        monkeypatch):
    from benchmarks import mfu

    started = _forked_children(monkeypatch)
    out = tmp_path / "mfu.json"
    # cuda_graphs is refused on the CPU (a failure, recorded); flash_attention is skipped without flash_attn.
    variants = "defaults,flash_attention,cuda_graphs,chunked_loss"
    assert mfu.main(["--dry-run", "--variants", variants, "--out", str(out)]) == 1
    saved = json.loads(out.read_text())
    assert saved["dry_run"] is True and saved["steps"] == 3
    assert [r["variant"] for r in saved["results"]] == variants.split(",")
    assert [cmd[4] for cmd in started] == ["defaults", "cuda_graphs", "chunked_loss"]  # flash_attention: no process
    ran = [saved["results"][0], saved["results"][3]]
    for result in ran:
        assert "error" not in result, result
        assert result["tokens_per_step"] == 4 * 32 and result["tokens_per_sec"] > 0 and result["step_time_p50_ms"] > 0
        assert math.isfinite(result["final_loss"]) and result["startup_phases_sec"]["first_step"] >= 0
        assert result["mfu"] is None and result["peak_memory_gib"] is None  # no GPU: no peak to divide by
    # The same weights and data: the chunked loss trains the same first steps within float rounding.
    assert ran[1]["final_loss"] == pytest.approx(ran[0]["final_loss"], rel=1e-4)
    flash, graphs = saved["results"][1], saved["results"][2]
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        assert "flash_attn" in flash["skipped"] and "error" not in flash
    assert "needs a CUDA device" in graphs["error"] and "needs a CUDA device" in open(graphs["log"]).read()
    assert os.path.dirname(graphs["log"]) == str(tmp_path / "mfu.logs")  # kept beside the results
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("defaults ") and "/ defaults 1.000" in lines[0] and lines[-1] == f"wrote {out}"
    assert lines[1].startswith("flash_attention  skipped:") and lines[2].startswith("cuda_graphs      failed:")


def test_a_variant_past_its_timeout_is_recorded_with_its_log_and_the_next_one_runs(tmp_path, monkeypatch):
    """Each variant's process runs with a fresh compile cache of its own; one killed at its timeout leaves a result
    (and its log), not an exception that loses the results file."""
    from benchmarks import mfu

    out = tmp_path / "mfu.json"
    seen = []
    real_popen = mfu.subprocess.Popen

    def popen(cmd, **kwargs):
        seen.append(kwargs["env"])
        proc = real_popen([mfu.sys.executable, "-c", "print('compiling', flush=True); import time; time.sleep(60)"],
                          **kwargs)
        # Handed back once the child has written its line (it then sleeps): the timeout, however short, finds a
        # log to keep and a child still running, whatever the machine's load.
        log, deadline = kwargs["stdout"].name, time.monotonic() + 60
        while open(log).read() != "compiling\n" and time.monotonic() < deadline:
            time.sleep(0.01)
        return proc

    monkeypatch.setattr(mfu.subprocess, "Popen", popen)
    assert mfu.main(["--dry-run", "--variants", "defaults,chunked_loss", "--timeout", "0.1", "--out", str(out)]) == 1
    results = json.loads(out.read_text())["results"]
    assert [r["error"] for r in results] == ["timed out after 0.1 s"] * 2
    assert all(open(r["log"]).read() == "compiling\n" for r in results)
    caches = [env["TORCHINDUCTOR_CACHE_DIR"] for env in seen]
    assert len(set(caches)) == 2 and all(env["TRITON_CACHE_DIR"].startswith(env["TORCHINDUCTOR_CACHE_DIR"])
                                         for env in seen)
