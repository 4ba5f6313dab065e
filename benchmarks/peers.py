"""accel_ddp against what users would pick instead, on matched work, alternated in one invocation.

Two comparisons (``--peers``):

    trainer     the Hugging Face Trainer (peer_trainer.py) and accel_ddp on the causal LM of docs/tasks.md:
                the 4-layer GPT-2 of examples/configs/tiny_gpt2.json on the Python Language Reference as packed
                128-token blocks, 16 per device, lr 2e-3, 20 warmup steps, cosine, clipping 1.0, 3 epochs
    lightning   PyTorch Lightning (peer_lightning.py) and accel_ddp on the MNIST CNN: mnist_cnn on the MNIST
                split of common.py, 64 per device, AdamW 3e-3, cosine, clipping 1.0, 3 epochs

Each peer with the defaults its docs give (``trainer``, ``lightning``). The Trainer's default AdamW is the fused
one accel_ddp also takes; Lightning's docs write ``torch.optim.AdamW``, which runs per tensor on the CPU, so
``lightning_fused`` (labelled apart) gives it accel_ddp's fused AdamW: the implementation of the same AdamW is
each framework's default, not the work. ``trainer_own_gelu`` (labelled apart) runs accel_ddp with
``--fused_kernels false``, the model's own Python tanh GELU as the Trainer runs it: what the one-kernel GELU
of accel_ddp's default adds to the comparison. accel_ddp runs with its defaults (``train.py`` with the
work's flags only). All sides are started the same way (``accelerate launch``), 2 processes over gloo, in
rounds whose order alternates. Figures per round, paired: samples/s over every epoch but the first (an
epoch's start to its last optimizer step, evaluation excluded, as accel_ddp's ``EpochTimer``), rank 0's CPU
time per step over the same window, start-up (process start to the first optimizer step, the slowest rank),
the whole launch's wall time, and the final evaluation (eval loss; accuracy for the CNN).

On a GPU (``--nproc 1`` on one): every side trains on it, in the same precision (``--mixed_precision auto``: bf16
where the GPU has it, as accel_ddp's GPU runs; the Trainer gets ``bf16=True``, Lightning ``bf16-mixed``), the
Trainer and Lightning choosing the device themselves (Lightning's ``accelerator="auto"``). A side that fails keeps
its whole log in ``OUT/logs/`` and its first traceback is printed.

    python benchmarks/peers.py                                      # both, 3 rounds (~25 min on 2 cores)
    python benchmarks/peers.py --peers trainer,lightning,lightning_fused --rounds 3
    python benchmarks/peers.py --peers lightning --rounds 5

Needs ``lightning`` for the Lightning side (``pip install lightning``; not a dependency of accel_ddp).
Writes ``OUT/peers.json`` (every run's figures, the table, the machine, the settings).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    TINY_GPT2_CONFIG,
    accel_epochs,
    alternated,
    bench_env,
    data_source,
    epoch_rates,
    exit_on_sigterm,
    launch_cmd,
    machine_info,
    machine_line,
    parser,
    pydoc_lm_folder,
    run_launch,
    spread,
    tail,
    threads_per_rank,
    write_json,
)

HERE = Path(__file__).resolve().parent
EPOCHS = 3
LM = {"per_device": 16, "lr": 2e-3, "warmup": 20}
CNN = {"per_device": 64, "lr": 3e-3}
PEERS = {  # name: (the comparison's work, the peer's script, its extra flags, accel_ddp's extra flags)
    "trainer": ("lm", "peer_trainer.py", [], []),
    "trainer_own_gelu": ("lm", "peer_trainer.py", [], ["--fused_kernels", "false"]),
    "lightning": ("cnn", "peer_lightning.py", [], []),
    "lightning_fused": ("cnn", "peer_lightning.py", ["--optimizer", "fused"], []),
}


def matched_precision(choice: str) -> str:
    """``auto``: bf16 on a GPU that has it (what accel_ddp's GPU runs use, and what each peer is then given), else
    no (fp32: on the CPU bf16 autocast is slower for these models); otherwise the choice itself."""
    if choice != "auto":
        return choice
    import torch

    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def accel_command(work: str, nproc: int, run_dir: Path, lm_data: str, extra: list[str],
                  mixed_precision: str = "no", epochs: int = EPOCHS) -> list[str]:
    """accel_ddp's train.py with the work's flags and nothing else (``extra``: a labelled variant's): its defaults
    decide the rest."""
    if work == "lm":
        flags = ["--task", "causal_lm", "--dataset", "hf", "--data_dir", lm_data, "--tokenizer", f"{lm_data}/tokenizer",
                 "--model_config", str(TINY_GPT2_CONFIG), "--packing",
                 "--max_length", "128", "--lr", str(LM["lr"]), "--warmup_steps", str(LM["warmup"]),
                 "--global_batch_size", str(LM["per_device"] * nproc)]
    else:
        flags = ["--dataset", "benchmarks.common:mnist_split", "--model", "mnist_cnn", "--lr", str(CNN["lr"]),
                 "--global_batch_size", str(CNN["per_device"] * nproc)]
    return launch_cmd(REPO / "train.py", [*flags, *extra, "--epochs", str(epochs), "--output_dir", str(run_dir)],
                      nproc, mixed_precision)


def peer_command(peer: str, nproc: int, run_dir: Path, lm_data: str, mixed_precision: str = "no",
                 epochs: int = EPOCHS) -> list[str]:
    """The peer's script with the work's flags and the same precision as accel_ddp's side (the Trainer's
    ``bf16=True``, Lightning's ``precision="bf16-mixed"``: each one's own switch for bf16 autocast)."""
    work, script, extra, _ = PEERS[peer]
    flags = (["--data_dir", lm_data, "--per_device_batch_size", str(LM["per_device"]), "--lr", str(LM["lr"]),
              "--warmup_steps", str(LM["warmup"])] if work == "lm"
             else ["--per_device_batch_size", str(CNN["per_device"]), "--lr", str(CNN["lr"])])
    return launch_cmd(HERE / script, [*flags, *extra, "--epochs", str(epochs), "--mixed_precision", mixed_precision,
                                      "--results_json", str(run_dir / "peer.json")], nproc, mixed_precision)


def keep_log(run_dir: Path, out: Path, name: str) -> Path:
    """A failed side's whole log, copied into the results folder (the run folders are temporary)."""
    kept = out / "logs" / f"{name}.log"
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run_dir / "log.txt", kept)
    return kept


def rates(epochs: list[dict], samples_per_step: int) -> dict:
    """Samples/s, CPU ms per step and steps per epoch over the epochs after the first (common.epoch_rates)."""
    got = epoch_rates(epochs, samples_per_step)
    return {key: got[key] for key in ("samples_per_sec", "cpu_ms_per_step", "steps_per_epoch")}


def parse(side: str, run_dir: Path, samples_per_step: int) -> dict:
    """A finished run's figures, from what each program writes (accel_ddp: summary.json and metrics.jsonl)."""
    if side != "accel":
        result = json.loads((run_dir / "peer.json").read_text())
        return {**rates(result["epochs"], result["samples_per_step"]), "startup_sec": result["startup_sec"],
                "eval_loss": result["eval_loss"], "eval_accuracy": result.get("eval_accuracy"),
                "optimizer_kernels": result.get("optimizer_kernels")}
    epochs, summary = accel_epochs(run_dir, samples_per_step)
    return {**rates(epochs, samples_per_step), "startup_sec": summary.get("startup_sec"),
            "eval_loss": summary.get("eval_loss"), "eval_accuracy": summary.get("eval_accuracy")}


def table(runs: list[dict], peers: list[str]) -> str:
    head = (f"{'peer':18} {'peer samples/s':>20} {'accel samples/s':>20} {'accel/peer':>19} | "
            f"{'CPU ms/step: peer':>21} {'accel':>21} {'accel/peer':>19} | {'start-up s: peer':>17} {'accel':>17} | "
            f"{'eval loss: peer':>15} {'accel':>7}")
    lines = [head, "-" * len(head)]
    for peer in peers:
        done = [r for r in runs if r["peer"] == peer and r["ok"]]
        rounds = {k: {r["side"]: r for r in done if r["round"] == k} for k in sorted({r["round"] for r in done})}
        paired = [(got["peer"], got["accel"]) for got in rounds.values() if {"peer", "accel"} <= got.keys()]

        peer_col = lambda key, spec, runs=paired: spread([p[key] for p, _ in runs], spec)  # noqa: E731
        accel_col = lambda key, spec, runs=paired: spread([a[key] for _, a in runs], spec)  # noqa: E731
        ratio = lambda key, runs=paired: spread([a[key] / p[key] for p, a in runs], ".3f")  # noqa: E731
        lines.append(f"{peer:18} {peer_col('samples_per_sec', '.1f'):>20} {accel_col('samples_per_sec', '.1f'):>20} "
                     f"{ratio('samples_per_sec'):>19} | {peer_col('cpu_ms_per_step', '.2f'):>21} "
                     f"{accel_col('cpu_ms_per_step', '.2f'):>21} {ratio('cpu_ms_per_step'):>19} | "
                     f"{peer_col('startup_sec', '.2f'):>17} {accel_col('startup_sec', '.2f'):>17} | "
                     f"{peer_col('eval_loss', '.4f'):>15} {accel_col('eval_loss', '.4f'):>7}")
    lines.append(f"median [min-max] over {len({r['round'] for r in runs})} alternated rounds; ratios paired per round; "
                 "samples/s and CPU ms/step (rank 0's process) over every epoch but the first; eval loss after the "
                 "last epoch")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, rounds=(3, "alternated rounds (peer first in even rounds)"), nproc=2, threads=None,
               out=(str(REPO / "outputs" / "benchmarks" / "peers"), "folder for peers.json"))
    p.add_argument("--peers", default="trainer,lightning", help=f"comma separated, from {','.join(PEERS)}")
    p.add_argument("--timeout", type=float, default=900, help="seconds before one run is ended")
    p.add_argument("--epochs", type=int, default=EPOCHS, help=f"epochs per run (the first is not measured; {EPOCHS})")
    p.add_argument("--mixed_precision", choices=("auto", "no", "bf16"), default="auto",
                   help="every side's precision; auto: bf16 on a GPU that has it, else no")
    args = p.parse_args(argv)
    exit_on_sigterm()
    peers = [x for x in args.peers.split(",") if x]
    if bad := [x for x in peers if x not in PEERS]:
        p.error(f"unknown peer(s) {bad}; choose from {', '.join(PEERS)}")
    args.threads = threads_per_rank(args.threads, args.nproc)
    args.mixed_precision = matched_precision(args.mixed_precision)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    print(f"data (cnn): {data_source()}")
    print(machine_line(machine, f"{args.nproc} processes, OMP_NUM_THREADS={args.threads}, mixed precision "
                                f"{args.mixed_precision} on every side"), flush=True)
    runs: list[dict] = []
    result = {"settings": vars(args), "machine": machine, "runs": runs}
    env = bench_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="accel_ddp_peers_") as tmp:
        lm_data = pydoc_lm_folder(Path(tmp)) if any(PEERS[x][0] == "lm" for x in peers) else ""
        for k in range(args.rounds):
            for peer in peers:
                work = PEERS[peer][0]
                samples_per_step = (LM if work == "lm" else CNN)["per_device"] * args.nproc
                for side in alternated(("peer", "accel"), k):
                    run_dir = Path(tmp) / f"{peer}_{side}_{k}"
                    run_dir.mkdir()
                    precision = args.mixed_precision
                    cmd = (accel_command(work, args.nproc, run_dir, lm_data, PEERS[peer][3], precision, args.epochs)
                           if side == "accel" else peer_command(peer, args.nproc, run_dir, lm_data, precision,
                                                                args.epochs))
                    info = run_launch(cmd, env, run_dir / "log.txt", args.timeout)
                    record = {"peer": peer, "side": side, "round": k, "rc": info["rc"], "wall_sec": info["wall_sec"],
                              "load_avg": os.getloadavg()[0], "ok": False}
                    try:
                        record.update(parse(side, run_dir, samples_per_step), ok=info["rc"] == 0)
                    except (OSError, ValueError, KeyError, ZeroDivisionError) as err:
                        record["error"] = f"{type(err).__name__}: {err}"
                    if not record["ok"]:  # the whole log kept, its cause (the first traceback) on the screen
                        record["log"] = str(keep_log(run_dir, out, f"{peer}_{side}_{k}"))
                        record["log_tail"] = tail(run_dir / "log.txt", 60)
                    runs.append(record)
                    status = (f"{record['samples_per_sec']:.1f} samples/s, eval loss {record['eval_loss']:.4f}"
                              if record["ok"] else f"FAILED (exit {info['rc']}; whole log: {record['log']}):\n"
                              f"{record['log_tail']}")
                    print(f"  round {k} {peer} {side:5} {status} (wall {info['wall_sec']:.1f}s, "
                          f"load {record['load_avg']:.1f})", flush=True)
                    write_json(out / "peers.json", result, say=False)
    text = table(runs, peers)
    print("\n" + text)
    result["table_text"] = text
    write_json(out / "peers.json", result)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
