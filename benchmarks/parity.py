"""Parity with the bare DDP loop, in the spirit of Lightning's parity test: the same seed, model and batches in
``bare_ddp.py`` and in accel_ddp end with the same weights, and the step-time ratio is printed.

Both sides run ``tax.py``'s ``sgd`` pair (SGD, momentum 0.9, Nesterov, no clipping, constant LR, no weight
decay) on one workload, launched the same way, alternated over ``--rounds`` (bare first in even rounds):
the bare loop's samples are the permutation accel_ddp's device loader draws (``epoch_order``), so every
optimizer step sees the same samples on the same rank. accel_ddp evaluates after each epoch, which moves
no weight and no training RNG. The final weights are compared tensor by tensor:

    bitwise equal, or the largest absolute difference, against TOLERANCE (1e-6 absolute: float32 SGD over
    a few hundred steps; a different reduction order would show as ~1e-7, a different sample or step as
    orders of magnitude more)

    python benchmarks/parity.py                        # mlp, 2 processes, 2 epochs, 2 rounds
    python benchmarks/parity.py --workload cnn --epochs 1

Exit code 0 when every round's weights agree within the tolerance, 1 otherwise.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import alternated, bench_env, median, parser, run_launch, tail, threads_per_rank  # noqa: E402
from benchmarks.tax import WORKLOADS, commands, lm_data, parse  # noqa: E402

TOLERANCE = 1e-6  # largest absolute weight difference accepted (float32)
PAIR = "sgd"  # no clipping, constant schedule: both sides' update is the same formula


def compare(bare: Path, accel: Path) -> tuple[bool, float]:
    """(bitwise equal, largest absolute difference) between two safetensors files with the same keys."""
    from safetensors.torch import load_file

    a, b = load_file(str(bare)), load_file(str(accel))
    if a.keys() != b.keys():
        raise SystemExit(f"the weights' keys differ: {sorted(a.keys() ^ b.keys())[:6]}")
    bitwise = all(a[k].equal(b[k]) for k in a)
    return bitwise, max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def one_round(k: int, args, tmp: Path, env: dict) -> dict:
    folders, rates = {}, {}
    for side in alternated(("bare", "accel"), k):
        run_dir = tmp / f"{side}_{k}"
        run_dir.mkdir()
        cmd = commands(args.workload, PAIR, side, args.nproc, args.epochs, run_dir, lm_data=lm_data(args.workload, tmp))
        if side == "bare":
            cmd += ["--save_weights", str(run_dir / "model.safetensors")]
        info = run_launch(cmd, env, run_dir / "log.txt", args.timeout)
        if info["rc"] != 0:
            raise SystemExit(f"round {k} {side} failed (exit {info['rc']}):\n{tail(run_dir / 'log.txt', 15)}")
        folders[side] = run_dir
        rates[side] = parse(side, run_dir, WORKLOADS[args.workload][2])["steps_per_sec"]
    bitwise, diff = compare(folders["bare"] / "model.safetensors", folders["accel"] / "model.safetensors")
    return {"bitwise": bitwise, "max_abs_diff": diff, "ratio": rates["accel"] / rates["bare"], **rates}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, nproc=2, rounds=(2, "alternated rounds (bare first in even rounds)"))
    p.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    env = bench_env(threads_per_rank(None, args.nproc))
    results = []
    with tempfile.TemporaryDirectory(prefix="accel_ddp_parity_") as tmp:
        for k in range(args.rounds):
            r = one_round(k, args, Path(tmp), env)
            results.append(r)
            print(f"round {k}: weights {'bitwise equal' if r['bitwise'] else 'differ'} (max |diff| "
                  f"{r['max_abs_diff']:.3g}, tolerance {TOLERANCE:g}); steps/s bare {r['bare']:.1f}, accel_ddp "
                  f"{r['accel']:.1f}, ratio {r['ratio']:.3f}", flush=True)
    ok = all(r["max_abs_diff"] <= TOLERANCE for r in results)
    print(f"{args.workload}, {args.nproc} processes, {args.epochs} epochs, pair {PAIR}: weights "
          f"{'agree' if ok else 'DISAGREE'} in every round; step-time ratio accel_ddp/bare (steps/s) median "
          f"{median([r['ratio'] for r in results]):.3f} over {len(results)} alternated rounds; load "
          f"{os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
