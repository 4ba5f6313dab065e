"""The per-batch cost of the nan/inf input check (accel_ddp.data.non_finite), measured inside a DataLoader worker.

Each batch's worker times torch's ``default_collate`` of the samples and then the check of the collated batch
(``batch_problem``: one ``isfinite`` pass over every floating tensor); the script prints both per batch and their
ratio, for float32 image batches of two sizes.

    python benchmarks/non_finite_check.py --batches 20
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel_ddp.data.non_finite import batch_problem  # noqa: E402
from benchmarks.common import parser, ratio  # noqa: E402


class Images(Dataset):
    def __init__(self, n: int, shape: tuple[int, ...]):
        self.n, self.sample = n, torch.randn(shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return self.sample.clone(), index % 10


def timed_collate(samples):
    start = time.perf_counter()
    batch = default_collate(samples)
    collated = time.perf_counter()
    assert batch_problem(batch, str) is None
    return (collated - start, time.perf_counter() - collated)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batches", type=int, default=20, help="batches per size (the first two warm the worker up)")
    args = p.parse_args()
    torch.set_num_threads(1)
    for batch_size, shape in ((256, (3, 32, 32)), (64, (3, 224, 224))):
        loader = DataLoader(Images(batch_size * args.batches, shape), batch_size=batch_size, num_workers=1,
                            collate_fn=timed_collate)
        times = list(loader)[2:]  # the first batches warm the worker up
        collate = sum(t[0] for t in times) / len(times)
        check = sum(t[1] for t in times) / len(times)
        print(f"float32 batch {batch_size}x{'x'.join(map(str, shape))}: collate {collate * 1e3:.2f} ms, check "
              f"{check * 1e3:.2f} ms per batch in the worker ({ratio(check, collate)}x the collate)")


if __name__ == "__main__":
    main()
