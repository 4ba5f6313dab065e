"""benchmarks/peers.py's plumbing on this CPU machine: a side that fails keeps its whole log (issue 38: the Trainer's
crash on the first GPU run left two lines, and the cause was lost)."""

from __future__ import annotations

import json
import sys

FAILS = ("import sys\n"
         "for i in range(300): print(f'line {i} of the peer', flush=True)\n"
         "raise RuntimeError('No backend type associated with device type cpu')\n")


def test_a_failed_side_keeps_its_whole_log_in_the_results_folder_and_prints_its_traceback(tmp_path, capsys,
                                                                                             monkeypatch):
    from benchmarks import peers

    monkeypatch.setattr(peers, "peer_command", lambda *args: [sys.executable, "-c", FAILS])
    monkeypatch.setattr(peers, "accel_command", lambda *args: [sys.executable, "-c", "raise SystemExit(3)"])
    code = peers.main(["--peers", "lightning", "--rounds", "1", "--nproc", "1", "--out", str(tmp_path),
                       "--timeout", "60"])
    out = capsys.readouterr().out
    assert code == 1
    kept = tmp_path / "logs" / "lightning_peer_0.log"
    lines = kept.read_text().splitlines()
    assert [f"line {i} of the peer" for i in range(300)] == lines[:300]  # every line, not a tail
    assert "RuntimeError: No backend type associated with device type cpu" in lines[-1]
    assert f"FAILED (exit 1; whole log: {kept})" in out
    assert "Traceback (most recent call last)" in out and "RuntimeError: No backend type" in out
    assert "line 0 of the peer" not in out  # the screen gets the cause, the file the whole log
    saved = json.loads((tmp_path / "peers.json").read_text())
    runs = {r["side"]: r for r in saved["runs"]}
    assert runs["peer"]["log"] == str(kept) and runs["accel"]["log"].endswith("lightning_accel_0.log")
    assert saved["settings"]["mixed_precision"] == "no"  # auto on a machine without a GPU: fp32 on every side


def test_every_side_gets_the_same_precision_on_the_launcher_and_in_its_own_flags(tmp_path):
    from benchmarks import peers

    accel = peers.accel_command("cnn", 1, tmp_path, "", [], "bf16")
    peer = peers.peer_command("trainer", 1, tmp_path, "data", "bf16")
    for cmd in (accel, peer):
        assert cmd[cmd.index("--mixed_precision") + 1] == "bf16"  # accelerate launch's own flag
    assert peer[len(peer) - 1 - peer[::-1].index("--mixed_precision") + 1] == "bf16"  # the peer script's flag
