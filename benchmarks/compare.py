"""Throughput: the textbook DDP script vs the Accelerate-example script vs accel_ddp, alternated in one invocation.

Same model (examples/mnist CNN = accel_ddp's ``mnist_cnn``), data (MNIST 8,000/2,000 split, see
``common.py``), global batch, optimizer steps and world size for every variant; every variant is
started the same way (``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml
--num_processes N``, i.e. torchrun) with the same thread count per rank. Runs alternate
(a, b, c, ..., then b, c, ..., a: the order rotates each repeat) and the table reports medians
over the repeats, because the machine is shared and noisy; ratios to (a) are the medians of
per-repeat paired ratios. The best run of each is shown too: other jobs only ever slow a run down.

Variants (``--variants``, comma separated):

    a      textbook_ddp.py: DDP + DistributedSampler + torchvision MNIST (PIL, ToTensor, Normalize), Adadelta
    b      accelerate_example.py: the same loop written as Accelerate's example scripts
    c      accel_ddp defaults (train.py --model mnist_cnn, in-memory tensors, --loader auto)
    c_pil  accel_ddp on (a)'s exact input pipeline (torchvision MNIST + per-sample PIL transforms)
    c_dl   accel_ddp, in-memory tensors, --loader dataloader
    c_fast accel_ddp, in-memory tensors, --loader device
    c_narrow accel_ddp defaults with the half-width CNN (benchmarks.common:cnn_narrow)
    c_cl   accel_ddp defaults with --channels_last

    python benchmarks/compare.py                       # a,b,c,c_pil; 1 and 2 processes; 3 repeats
    python benchmarks/compare.py --steps 300 --repeats 5 --variants a,c,c_fast

Writes ``OUT/compare.json`` (every run's raw figures, the aggregates, machine and settings) and
``OUT/compare.png``. Samples/s is optimizer steps x global batch / training-loop seconds (eval and
startup excluded), as accel_ddp's ``summary.json`` defines ``train_samples_per_sec``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    bench_env,
    data_source,
    exit_on_sigterm,
    fmt,
    launch_cmd,
    machine_info,
    machine_line,
    median,
    parser,
    percentile,
    prepare_torchvision_root,
    read_jsonl,
    rotated,
    run_launch,
    tail,
    threads_per_rank,
    through,
    write_json,
)

HERE = Path(__file__).resolve().parent
LABELS = {
    "a": "(a) textbook DDP",
    "b": "(b) Accelerate example",
    "c": "(c) accel_ddp defaults",
    "c_pil": "(c) accel_ddp, (a)'s PIL pipeline",
    "c_dl": "(c) accel_ddp --loader dataloader",
    "c_fast": "(c) accel_ddp --loader device",
    "c_narrow": "(c) accel_ddp, half-width CNN",
    "c_cl": "(c) accel_ddp --channels_last",
}
# Fields accel_ddp's summary.json may carry (issue 5 point 5); read when present.
SUMMARY_STEP_FIELDS = ("step_time_p50_ms", "step_time_p90_ms", "data_wait_share")


def variant_cmd(variant: str, nproc: int, args, run_dir: Path, tv_root: Path) -> list[str]:
    per_device = args.global_batch_size // nproc
    common = ["--max_steps", str(args.steps)]
    if variant in ("a", "b"):
        script = HERE / ("textbook_ddp.py" if variant == "a" else "accelerate_example.py")
        extra = ["--cpu"] if (variant == "b" and not args.cuda) else []
        return launch_cmd(script, [
            *extra, "--data_dir", str(tv_root), "--batch_size", str(per_device), *common,
            "--num_workers", str(args.num_workers),
            "--results_json", str(run_dir / "results.json"), "--save_path", str(run_dir / "model.pt"),
        ], nproc)
    dataset = "benchmarks.common:mnist_split_pil" if variant == "c_pil" else "benchmarks.common:mnist_split"
    model = "benchmarks.common:cnn_narrow" if variant == "c_narrow" else "mnist_cnn"
    flags = ["--dataset", dataset, "--data_dir", str(tv_root), "--model", model,
             "--global_batch_size", str(args.global_batch_size), *common, "--output_dir", str(run_dir)]
    if variant == "c_pil":
        flags += ["--num_workers", str(args.num_workers)]  # the same worker count as (a)
    if variant == "c_dl":
        flags += ["--loader", "dataloader"]
    if variant == "c_fast":
        flags += ["--loader", "device"]
    if variant == "c_cl":
        flags += ["--channels_last"]
    return launch_cmd(REPO / "train.py", flags, nproc)


def window_step_times(metrics: list[dict]) -> list[float]:
    """Mean step time (ms) of each logging window, from metrics.jsonl's step lines and timestamps.

    The first window (startup to the first log) is left out: it has no start time.
    """
    steps = [(r["step"], r["time"]) for r in metrics if "loss" in r and "step" in r and "time" in r]
    out = []
    for (s0, t0), (s1, t1) in zip(steps, steps[1:], strict=False):
        if s1 > s0:
            out.append(1000 * (t1 - t0) / (s1 - s0))
    return out


def parse_run(variant: str, run_dir: Path) -> dict:
    """Figures of one finished run; the same keys for every variant."""
    if variant in ("a", "b"):
        res = json.loads((run_dir / "results.json").read_text())
        times = res["step_times_ms"]
        return {
            "samples_per_sec": res["train_samples_per_sec"], "train_seconds": res["train_seconds"],
            "step_p50_ms": percentile(times, 50), "step_p90_ms": percentile(times, 90),
            "step_time_source": "per step", "data_wait_share": res["data_wait_share"],
            "eval_accuracy": res["eval_accuracy"], "loader": "DataLoader (PIL)",
        }
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {"samples_per_sec": summary["train_samples_per_sec"], "train_seconds": summary.get("train_seconds"),
           "eval_accuracy": summary.get("eval_accuracy"), "data_wait_share": summary.get("data_wait_share")}
    if summary.get("step_time_p50_ms") is not None:
        out.update(step_p50_ms=summary["step_time_p50_ms"], step_p90_ms=summary.get("step_time_p90_ms"),
                   step_time_source="summary.json")
    else:  # not logged by this accel_ddp yet: percentiles of the per-window means in metrics.jsonl
        windows = window_step_times(read_jsonl(run_dir / "metrics.jsonl"))
        out.update(step_p50_ms=percentile(windows, 50), step_p90_ms=percentile(windows, 90),
                   step_time_source="log-window means")
    out["loader"] = summary.get("loader") or _resolved_loader(run_dir) or "not reported"
    out["summary_extra"] = {k: summary[k] for k in SUMMARY_STEP_FIELDS if k in summary}
    return out


def _resolved_loader(run_dir: Path) -> str | None:
    try:
        import yaml

        resolved = yaml.safe_load((run_dir / "config.yaml").read_text()).get("resolved", {})
    except (OSError, AttributeError, ValueError):
        return None
    return resolved.get("loader")


def aggregate(runs: list[dict], variants: list[str], procs: list[int]) -> list[dict]:
    rows = []
    for nproc in procs:
        for v in variants:
            mine = [r for r in runs if r["variant"] == v and r["nproc"] == nproc and r.get("ok")]
            paired = []
            for r in mine:
                base = [b for b in runs if b["variant"] == "a" and b["nproc"] == nproc and b["repeat"] == r["repeat"]
                        and b.get("ok")]
                if base:
                    paired.append(r["samples_per_sec"] / base[0]["samples_per_sec"])
            sps = [r["samples_per_sec"] for r in mine]
            rows.append({
                "variant": v, "label": LABELS[v], "nproc": nproc, "runs": len(mine),
                "samples_per_sec": median(sps), "samples_per_sec_min": min(sps, default=math.nan),
                "samples_per_sec_max": max(sps, default=math.nan),
                "step_p50_ms": median([r["step_p50_ms"] for r in mine]),
                "step_p90_ms": median([r["step_p90_ms"] for r in mine]),
                "step_time_source": mine[0]["step_time_source"] if mine else None,
                "data_wait_share": median([r["data_wait_share"] for r in mine if r["data_wait_share"] is not None]),
                "ratio_to_a": median(paired), "ratio_to_a_runs": paired,
                "ratio_to_a_best": None,
                "loader": mine[0]["loader"] if mine else None,
            })
    for row in rows:
        # Scaling efficiency from 1 to N processes: sps(N) / (N * sps(1)), on medians and on bests. Noise from
        # other jobs only ever slows a run down, so the best of N runs is the steadier estimate of capability.
        single = [r for r in rows if r["variant"] == row["variant"] and r["nproc"] == 1]
        multi = bool(single) and row["nproc"] > 1
        row["scaling_efficiency"] = (row["samples_per_sec"] / (row["nproc"] * single[0]["samples_per_sec"])
                                     if multi else None)
        row["scaling_efficiency_best"] = (row["samples_per_sec_max"] / (row["nproc"] * single[0]["samples_per_sec_max"])
                                          if multi else None)
        base = [r for r in rows if r["variant"] == "a" and r["nproc"] == row["nproc"]]
        if base:
            row["ratio_to_a_best"] = row["samples_per_sec_max"] / base[0]["samples_per_sec_max"]
    return rows


def pct(share) -> str:
    text = fmt(None if share is None else share * 100, ".1f")
    return text if text == "-" else text + "%"


def print_table(rows: list[dict]) -> str:
    head = (f"{'variant':36} {'procs':>5} {'samples/s':>9} {'p50 ms':>7} {'p90 ms':>7} {'data wait':>9} "
            f"{'x (a)':>5} {'scaling':>7} | {'best/s':>6} {'x (a)':>5} {'scaling':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        star = "~" if r["step_time_source"] == "log-window means" else " "
        lines.append(
            f"{r['label']:36} {r['nproc']:>5} {fmt(r['samples_per_sec']):>9} "
            f"{star}{fmt(r['step_p50_ms'], '.1f'):>6} {star}{fmt(r['step_p90_ms'], '.1f'):>6} "
            f"{pct(r['data_wait_share']):>9} {fmt(r['ratio_to_a'], '.2f'):>5} "
            f"{fmt(r['scaling_efficiency'], '.2f'):>7} | "
            f"{fmt(r['samples_per_sec_max']):>6} {fmt(r['ratio_to_a_best'], '.2f'):>5} "
            f"{fmt(r['scaling_efficiency_best'], '.2f'):>7}"
        )
    text = "\n".join(lines)
    text += ("\nmedians over repeats (x (a): median of per-repeat paired ratios); right of |: best run of each "
             "(other jobs only slow runs down)")
    if any(r["step_time_source"] == "log-window means" for r in rows):
        text += ("\n~ accel_ddp does not log per-step times yet: p50/p90 of the mean step time of each "
                 "--log_every window (metrics.jsonl timestamps)")
    return text


def plot(rows: list[dict], variants: list[str], procs: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.5, 1.9 * len(variants)), 4.6))
    width = 0.8 / len(procs)
    for j, nproc in enumerate(procs):
        vals, lo, hi = [], [], []
        for v in variants:
            row = next(r for r in rows if r["variant"] == v and r["nproc"] == nproc)
            vals.append(row["samples_per_sec"])
            lo.append(row["samples_per_sec"] - row["samples_per_sec_min"])
            hi.append(row["samples_per_sec_max"] - row["samples_per_sec"])
        xs = [i + (j - (len(procs) - 1) / 2) * width for i in range(len(variants))]
        bars = ax.bar(xs, vals, width, yerr=[lo, hi], capsize=3, label=f"{nproc} process{'es' if nproc > 1 else ''}")
        for bar, v in zip(bars, variants, strict=True):
            row = next(r for r in rows if r["variant"] == v and r["nproc"] == nproc)
            top = max(row["samples_per_sec"], row["samples_per_sec_max"])  # above the error bar
            ax.annotate(f"{row['ratio_to_a']:.2f}x", (bar.get_x() + bar.get_width() / 2, top),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 4), textcoords="offset points")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.08)  # room for the top label
    ax.set_xticks(range(len(variants)))
    ax.set_xticklabels([textwrap.fill(LABELS[v], 18) for v in variants], fontsize=8)
    ax.set_ylabel("training samples/s (median; bars: min-max)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PROFILE_GROUPS = (  # (label, how a profiler event name starts); times are main-thread CPU totals incl. children
    ("data", ("enumerate(DataLoader)",)),
    ("forward", ("DistributedDataParallel.forward",)),
    ("backward", ("autograd::engine::evaluate_function",)),
    ("optimizer", ("Optimizer.step#",)),
    ("clip", ("aten::_foreach_norm", "aten::linalg_vector_norm")),
)
PROFILE_SKIP = 8  # optimizer steps before the profiled window (warm-up); the window ends 2 steps before the last


def profile_child(argv: list[str]) -> int:
    """``compare.py --profile_child OUT.json SCRIPT ARGS...``: run SCRIPT under torch.profiler (CPU) on this rank.

    Started by ``accelerate launch`` in place of SCRIPT, so the variant runs unchanged. A global
    optimizer-step hook advances the profiler's schedule, so the window holds only training steps
    (no startup, no evaluation) whatever the script. Rank 0 writes the grouped times to OUT.json
    and the op table to OUT.txt.
    """
    import runpy
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    out_json, script, script_args = Path(argv[0]), argv[1], argv[2:]
    active = int(os.environ["BENCH_PROFILE_ACTIVE"])
    clocks: list[tuple[float, float]] = []  # (wall, process CPU) at the window's first and last step

    def on_step(*_) -> None:
        on_step.count += 1
        if on_step.count in (PROFILE_SKIP, PROFILE_SKIP + active):  # before prof.step(): the last one reports
            clocks.append((time.perf_counter(), time.process_time()))
        prof.step()

    on_step.count = 0

    def report(prof) -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        events = prof.key_averages()
        steps = [e for e in events if e.key.startswith("ProfilerStep")]
        n_steps = sum(e.count for e in steps)
        per_step = lambda sec: 1000 * sec / max(n_steps, 1)
        groups = {label: per_step(sum(e.cpu_time_total for e in events if e.key.startswith(prefixes)) / 1e6)
                  for label, prefixes in PROFILE_GROUPS}
        top = [{"op": e.key, "self_ms_per_step": per_step(e.self_cpu_time_total / 1e6), "calls": e.count}
               for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]]
        comm = sum(e.self_cpu_time_total for e in events if e.key.startswith("c10d::")) / 1e6
        # CPU seconds of this rank's process (all its threads) per wall second: 1.0 = one core all the time.
        core_share = ((clocks[1][1] - clocks[0][1]) / (clocks[1][0] - clocks[0][0])) if len(clocks) == 2 else None
        out_json.write_text(json.dumps({
            "core_share": core_share,
            "profiled_steps": n_steps, "step_ms": per_step(sum(e.cpu_time_total for e in steps) / 1e6),
            "groups_ms_per_step": groups, "c10d_ms_per_step": per_step(comm), "top_ops": top}, indent=1) + "\n")
        out_json.with_suffix(".txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=40))

    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    prof = profile(activities=[ProfilerActivity.CPU], on_trace_ready=report,
                   schedule=schedule(wait=PROFILE_SKIP - 3, warmup=3, active=active, repeat=1))
    hook = register_optimizer_step_post_hook(on_step)
    code = 0
    prof.start()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        hook.remove()
        prof.stop()
    return code


def run_profile(args, variants: list[str], procs: list[int], threads: int, out: Path) -> int:
    """One profiled run per variant and world size; prints ms per optimizer step for each part of the step."""
    active = args.steps - PROFILE_SKIP - 2
    if active < 5:
        raise SystemExit(f"--profile needs --steps >= {PROFILE_SKIP + 7}")
    labels = [g[0] for g in PROFILE_GROUPS]
    head = (f"{'variant':36} {'procs':>5} {'step':>7} " + " ".join(f"{g:>9}" for g in labels)
            + f" {'other':>7} | {'c10d':>6} {'core':>5}")
    lines = [head, "-" * len(head)]
    with tempfile.TemporaryDirectory(prefix="accel_ddp_profile_") as tmp:
        tv_root = prepare_torchvision_root(Path(tmp) / "tv")
        env = bench_env(threads, {"BENCH_PROFILE_ACTIVE": str(active)})
        for nproc in procs:
            for v in variants:
                run_dir = Path(tmp) / f"{v}_{nproc}"
                run_dir.mkdir()
                prof_json = out / f"profile_{v}_{nproc}p.json"
                cmd = through(variant_cmd(v, nproc, args, run_dir, tv_root),
                              [str(Path(__file__).resolve()), "--profile_child", str(prof_json)])
                info = run_launch(cmd, env, run_dir / "log.txt", args.timeout)
                if info["rc"] != 0 or not prof_json.is_file():
                    print(f"{v} {nproc}p FAILED:\n{tail(run_dir / 'log.txt', 20)}")
                    continue
                prof = json.loads(prof_json.read_text())
                parts = [prof["groups_ms_per_step"][g] for g in labels]
                lines.append(f"{LABELS[v]:36} {nproc:>5} {prof['step_ms']:>7.1f} "
                             + " ".join(f"{x:>9.1f}" for x in parts)
                             + f" {prof['step_ms'] - sum(parts):>7.1f} | {prof['c10d_ms_per_step']:>6.1f} "
                             + f"{fmt(prof.get('core_share'), '.2f'):>5}")
                top = "\n".join(f"    {t['op'][:60]:60} self {t['self_ms_per_step']:7.1f} ms/step"
                                for t in prof["top_ops"][:10])
                print(f"{LABELS[v]}, {nproc} process(es), {prof['profiled_steps']} steps: top ops by self CPU time "
                      f"(rank 0)\n{top}", flush=True)
    table = "\n".join(lines)
    table += ("\nms per optimizer step on rank 0 under torch.profiler (training steps only; the profiler adds a "
              "little per op).\nforward/backward/optimizer/clip/data: main-thread time incl. children; other: the "
              "rest of the step;\nc10d: time in c10d collectives launched from the main thread (inside backward "
              "for DDP's buckets);\ncore: CPU seconds of rank 0's process (all threads) per wall second over the "
              "window (1.00 = a whole core; less = waiting on the other rank or on other jobs)")
    print()
    print(table)
    (out / "profile.txt").write_text(table + "\n")
    print(f"\nwrote {out}/profile.txt, profile_*.json and profile_*.txt (op tables)")
    return 0


def chart_title(steps: int, batch: int, repeats: int, machine: dict, threads: int) -> str:
    return (f"MNIST CNN, {steps} steps x global batch {batch}, median of {repeats} alternated runs\n"
            f"{machine['cpus']} CPUs ({machine['cpu']}), {threads} thread(s)/rank, {machine['date']}; labels: x (a)")


def replot(path: Path) -> int:
    """Table and chart again from a compare.json (after a change to the chart, or to re-aggregate)."""
    data = json.loads(path.read_text())
    st = data["settings"]
    rows = aggregate(data["runs"], st["variants"], st["procs"])
    print(print_table(rows))
    png = path.with_suffix(".png")
    plot(rows, st["variants"], st["procs"], png,
         chart_title(st["steps"], st["global_batch_size"], st["repeats"], data["machine"], st["threads_per_rank"]))
    print(f"wrote {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, steps=100, repeats=(3, "rounds of alternated runs; the table shows medians"),
               threads=(None, "OMP_NUM_THREADS per rank; default CPUs // largest world size (1 on 2 cores), the "
                              "same for every world size so that each rank owns the same cores"),
               out=(str(REPO / "outputs" / "benchmarks" / "compare"), "folder for JSON, PNG"))
    p.add_argument("--variants", default="a,b,c,c_pil", help=f"comma separated, from {','.join(LABELS)}")
    p.add_argument("--procs", default="1,2", help="world sizes to run, comma separated")
    p.add_argument("--global_batch_size", type=int, default=64, help="samples per optimizer step over all ranks")
    p.add_argument("--num_workers", type=int, default=0, help="DataLoader workers of (a), (b) and c_pil")
    p.add_argument("--timeout", type=float, default=900, help="seconds before one run is ended")
    p.add_argument("--replot", metavar="COMPARE_JSON", help="redraw the table and chart of an earlier compare.json")
    p.add_argument("--profile", action="store_true",
                   help="instead of the comparison: one run per variant under torch.profiler, time per step by part")
    args = p.parse_args(argv)
    exit_on_sigterm()

    if args.replot:
        return replot(Path(args.replot))

    import torch

    args.cuda = torch.cuda.is_available()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in LABELS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(LABELS)}")
    if "a" not in variants and not args.profile:
        variants.insert(0, "a")  # every ratio is to (a)
    procs = [int(n) for n in args.procs.split(",")]
    if any(args.global_batch_size % n for n in procs):
        p.error(f"--global_batch_size {args.global_batch_size} must divide by every world size in {procs}")
    threads = threads_per_rank(args.threads, max(procs))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = data_source()
    machine = machine_info()
    print(f"data: {source}")
    print(machine_line(machine, f"OMP_NUM_THREADS={threads} per rank"))
    if args.profile:
        return run_profile(args, variants, procs, threads, out)
    print(f"{args.steps} steps x global batch {args.global_batch_size}, {args.repeats} repeats, order "
          f"{' '.join(variants)} per world size {procs}", flush=True)

    runs: list[dict] = []
    result = {"settings": {**vars(args), "threads_per_rank": threads, "variants": variants, "procs": procs},
              "data_source": source, "machine": machine, "runs": runs}
    with tempfile.TemporaryDirectory(prefix="accel_ddp_compare_") as tmp:
        tv_root = prepare_torchvision_root(Path(tmp) / "tv")
        env = bench_env(threads)
        for repeat in range(args.repeats):
            # The order rotates each repeat (a b c, b c a, c a b, ...) so that drift within a round of runs on a
            # shared machine does not always favour the same variant; paired ratios use the same repeat.
            order = rotated(variants, repeat)
            for nproc in procs:
                for v in order:
                    run_dir = Path(tmp) / f"{v}_{nproc}_{repeat}"
                    run_dir.mkdir()
                    log = run_dir / "log.txt"
                    info = run_launch(variant_cmd(v, nproc, args, run_dir, tv_root), env, log, args.timeout)
                    record = {"variant": v, "nproc": nproc, "repeat": repeat, "wall_sec": info["wall_sec"],
                              "cpu_sec": info["cpu_sec"],
                              "rc": info["rc"], "load_avg": os.getloadavg()[0]}
                    try:
                        record.update(parse_run(v, run_dir), ok=info["rc"] == 0)
                    except (OSError, ValueError, KeyError) as err:
                        record.update(ok=False, error=f"{type(err).__name__}: {err}", log_tail=tail(log))
                    runs.append(record)
                    status = (f"{record['samples_per_sec']:.0f} samples/s" if record["ok"]
                              else f"FAILED (exit {info['rc']}):\n{tail(log, 15)}")
                    print(f"  repeat {repeat} {nproc}p {v:6} {status} (wall {info['wall_sec']:.1f}s, "
                          f"load {record['load_avg']:.1f})", flush=True)
                    write_json(out / "compare.json", result, say=False)  # raw figures so far survive an interrupted run

    rows = aggregate(runs, variants, procs)
    table = print_table(rows)
    print()
    print(table)
    result["table"], result["table_text"] = rows, table
    write_json(out / "compare.json", result, say=False)
    out.mkdir(parents=True, exist_ok=True)  # again: the folder may have been cleaned meanwhile
    plot(rows, variants, procs, out / "compare.png", chart_title(args.steps, args.global_batch_size, args.repeats,
                                                                 machine, threads))
    print(f"\nwrote {out / 'compare.json'} and {out / 'compare.png'}")
    return 0 if all(r.get("ok") for r in runs) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--profile_child"]:
        sys.exit(profile_child(sys.argv[2:]))
    sys.exit(main())
