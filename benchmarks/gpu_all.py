"""Every GPU measurement of issue 38 in one go, within a time budget, into one results file.

    bash benchmarks/gpu_all.sh                       # on one GPU: installs what is missing (wheelhouse/), then this
    python benchmarks/gpu_all.py --out /tmp/all      # results in /tmp/all/gpu_all.json
    python benchmarks/gpu_all.py --dry-run           # no GPU: each stage's plumbing on the CPU, short
    python benchmarks/gpu_all.py --only tax,peers --budget 300

The stages, in order (``--only`` names), each a script of this folder with its own time cap, all within
``--budget`` seconds (default 470: under 8 minutes with the install and the start):

    gpu_check     gpu_check.py --only doctor,pytest_gpu: the @gpu tests run, and pass, under pytest (item 1)
    tax           tax.py on one GPU, mlp, cnn and the tiny GPT-2: accel_ddp's defaults against the bare loop
                  (item 3's framework tax), and --cuda_graphs against the eager bare loop (pair "graphs", item 4:
                  target >= 2x on cnn and lm); one alternated round
    ops_per_step  ops_per_step.py: ATen ops per optimizer step, accel_ddp against the bare loop (item 3), where
                  this checkout has the script
    peers         peers.py --nproc 1: the Trainer and Lightning against accel_ddp, same precision (item 5: target
                  >= 1.2x each), 2 epochs (the first not measured)

A stage gets its cap, or what the budget has left after keeping the later stages' floors, whichever is less; a
stage whose share is below its floor is SKIPped, saying so. Each stage's whole log is kept (``OUT/<stage>/log.txt``)
and a failure prints its first traceback. ``OUT/gpu_all.json`` is the one results file: per stage its status,
seconds, command, the results file its script wrote (embedded) and, when it failed, its log's tail; the machine.
Exit code 1 if a stage failed or ran out of time.

``--dry-run`` (without a GPU it is one): the same stages, cut to their plumbing on the CPU (tax.py on the mlp
with 2 epochs and the defaults pair: --cuda_graphs is refused on a CPU; ops_per_step.py on the mlp; peers
SKIPped: each side takes minutes on a CPU, and tests/test_peers.py covers its plumbing). It says nothing about a
GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, bench_env, machine_info, tail  # noqa: E402

HERE = REPO / "benchmarks"
BUDGET = 470  # seconds for every stage: with the install and the interpreter start, under 8 minutes


@dataclass
class Stage:
    name: str
    cap: float  # seconds at most
    floor: float  # seconds below which it is not worth starting
    gpu: list[str] | None  # the command on a GPU, ``{out}`` for its folder, ``{limit}`` for its seconds
    dry: list[str] | None  # the command of a dry run; None: SKIPped in a dry run (``dry_why`` says why)
    results: str  # the file its script writes in its folder (embedded in gpu_all.json)
    needs: str = ""  # a script this checkout must have (another branch may bring it)
    dry_why: str = ""
    env: dict[str, str] = field(default_factory=dict)


def stages() -> list[Stage]:
    py = sys.executable
    return [
        Stage("gpu_check", 100, 40,
              [py, str(HERE / "gpu_check.py"), "--only", "doctor,pytest_gpu", "--budget", "{limit}", "--out", "{out}"],
              [py, str(HERE / "gpu_check.py"), "--dry-run", "--only", "doctor,pytest_gpu", "--budget", "{limit}",
               "--out", "{out}"], "gpu_check.json"),
        Stage("tax", 200, 60,
              [py, str(HERE / "tax.py"), "--nproc", "1", "--workloads", "mlp,cnn,lm", "--pairs", "defaults,graphs",
               "--rounds", "1", "--timeout", "60", "--out", "{out}"],
              [py, str(HERE / "tax.py"), "--nproc", "1", "--workloads", "mlp", "--pairs", "defaults", "--rounds", "1",
               "--epochs", "2", "--timeout", "120", "--out", "{out}"], "tax.json"),
        Stage("ops_per_step", 50, 20,
              [py, str(HERE / "ops_per_step.py"), "--workloads", "mlp,cnn,lm", "--steps", "10", "--json",
               "{out}/ops_per_step.json"],
              [py, str(HERE / "ops_per_step.py"), "--workloads", "mlp", "--steps", "3", "--json",
               "{out}/ops_per_step.json"], "ops_per_step.json", needs="ops_per_step.py"),
        Stage("peers", 130, 60,
              [py, str(HERE / "peers.py"), "--nproc", "1", "--rounds", "1", "--peers", "trainer,lightning",
               "--epochs", "2", "--timeout", "60", "--out", "{out}"],
              None, "peers.json", dry_why="dry run: each side takes minutes on a CPU (tests/test_peers.py checks its "
                                          "plumbing)"),
    ]


def run_stage(stage: Stage, command: list[str], folder: Path, limit: float) -> dict:
    """Run one stage's command in its own session for at most ``limit`` seconds; its whole log in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [part.replace("{out}", str(folder)).replace("{limit}", str(int(limit))) for part in command]
    log = folder / "log.txt"
    started = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=bench_env(
            max(1, (os.cpu_count() or 1)), stage.env), start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the stage and every process it started
            proc.wait()
            rc = None
    record = {"status": "PASS" if rc == 0 else ("TIMEOUT" if rc is None else "FAIL"), "rc": rc,
              "seconds": round(time.perf_counter() - started, 1), "command": cmd, "log": str(log)}
    try:
        record["results"] = json.loads((folder / stage.results).read_text())
    except (OSError, ValueError):
        record["results"] = None
    if record["status"] != "PASS":
        record["log_tail"] = tail(log, 60)
    return record


def summary_line(stage: str, record: dict) -> str:
    """The stage's figure for its line: the table its script printed, shortened to its first rows."""
    results = record.get("results") or {}
    if "table_text" in results:
        return results["table_text"].splitlines()[2][:160] if len(results["table_text"].splitlines()) > 2 else ""
    if stage == "gpu_check":
        return "; ".join(f"{r['status']} {r['name']}" for r in results.get("results", []))
    if stage == "ops_per_step":
        return "; ".join(f"{w} {r['extra']:+.1f} ops/step" for w, r in results.get("results", {}).items())
    return record.get("reason", "")


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "outputs" / "gpu_all"))
    parser.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for all stages ({BUDGET})")
    parser.add_argument("--only", default="", help="comma-separated stage names (default: all, in order)")
    parser.add_argument("--dry-run", action="store_true", help="the plumbing on the CPU (also without a GPU)")
    args = parser.parse_args(argv)
    known = stages()
    chosen = [s for s in known if not args.only or s.name in args.only.split(",")]
    if unknown := set(filter(None, args.only.split(","))) - {s.name for s in known}:
        parser.error(f"unknown stage(s) {sorted(unknown)}; choose from {', '.join(s.name for s in known)}")
    dry = args.dry_run or not torch.cuda.is_available()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    print(f"gpu_all: {'dry run on the CPU (plumbing only: nothing here measures a GPU)' if dry else 'on the GPU'}; "
          f"torch {torch.__version__}; budget {args.budget:.0f}s; every stage's log under {out}", flush=True)
    result = {"dry_run": dry, "budget_sec": args.budget, "machine": machine, "stages": []}
    started = time.perf_counter()
    for k, stage in enumerate(chosen):
        left = args.budget - (time.perf_counter() - started)
        share = min(stage.cap, left - sum(s.floor for s in chosen[k + 1:]))
        command = stage.dry if dry else stage.gpu
        if stage.needs and not (HERE / stage.needs).is_file():
            record = {"status": "SKIP", "reason": f"benchmarks/{stage.needs} is not in this checkout"}
        elif command is None:
            record = {"status": "SKIP", "reason": stage.dry_why}
        elif share < stage.floor:
            record = {"status": "SKIP", "reason": f"budget spent: {max(share, 0):.0f}s left for it, needs "
                                                  f"{stage.floor:.0f}s (rerun with --only {stage.name})"}
        else:
            record = run_stage(stage, command, out / stage.name, share)
        record = {"name": stage.name, **record}
        result["stages"].append(record)
        print(f"{record['status']:7} {stage.name:13} {record.get('seconds', 0.0):6.1f}s  "
              f"{summary_line(stage.name, record)}", flush=True)
        if record["status"] in ("FAIL", "TIMEOUT"):
            print(f"        whole log: {record['log']}\n{record['log_tail']}", flush=True)
        (out / "gpu_all.json").write_text(json.dumps(result, indent=1) + "\n")
    result["elapsed_sec"] = round(time.perf_counter() - started, 1)
    for record in result["stages"]:
        text = (record.get("results") or {}).get("table_text")
        if text:
            print(f"\n== {record['name']}\n{text}")
    (out / "gpu_all.json").write_text(json.dumps(result, indent=1) + "\n")
    counts = {s: sum(r["status"] == s for r in result["stages"]) for s in ("PASS", "FAIL", "TIMEOUT", "SKIP")}
    print(f"\ngpu_all: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['TIMEOUT']} out of time, "
          f"{counts['SKIP']} skipped in {result['elapsed_sec']:.0f}s; results: {out / 'gpu_all.json'}")
    return 1 if counts["FAIL"] or counts["TIMEOUT"] else 0


if __name__ == "__main__":
    sys.exit(main())
