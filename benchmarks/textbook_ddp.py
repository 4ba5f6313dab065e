"""(a) The textbook PyTorch DDP recipe on MNIST: the baseline the other benchmarks are measured against.

Written as PyTorch's DDP tutorial (``init_process_group``, ``DistributedDataParallel``,
``DistributedSampler`` with ``set_epoch``, rank-0 ``torch.save``) plus pytorch/examples/mnist
(its ``Net``, torchvision ``MNIST`` of PIL images through ``ToTensor()`` + ``Normalize``,
Adadelta lr 1.0 with ``StepLR(step_size=1, gamma=0.7)``, batch 64, test batch 1000, 14 epochs,
``nll_loss`` on ``log_softmax``). Launch it the way the tutorial does, with torchrun (here through
``accelerate launch``, which runs torchrun for a MULTI_GPU config):

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml benchmarks/textbook_ddp.py \
        --data_dir /tmp/mnist_root --batch_size 32

``--batch_size`` is per process, as in the tutorial (global batch = batch_size x world size).
``--num_workers`` defaults to 0 as in the DDP tutorial (examples/mnist uses 1 with CUDA); on this
2-core machine each rank already owns one core, so a worker process only competes for it.

Benchmark instrumentation, not part of the recipe, is kept apart: per-step wall times and the
time spent waiting for the DataLoader (``perf_counter`` around each iteration, no extra syncs on
CPU), an eval-accuracy stream (``--metrics_jsonl``), a results file (``--results_json``),
``--max_steps``, ``--train_limit``/``--eval_from`` (subsets of a full torchvision root; the benchmarks
write their split as the root itself and do not need them) and
``--stop_at_accuracy`` (stop after the first epoch whose eval reaches it; time to accuracy).

One deviation from the tutorial, for like-for-like figures: with a single process the model is not
wrapped in DDP, because Accelerate does not wrap it either (``Accelerator.prepare`` wraps only when
``num_processes > 1``). A 1-process DDP still copies every gradient into its buckets and runs a
1-rank all-reduce per step; measured against accel_ddp, which skips both, that would credit
accel_ddp with DDP's overhead. ``--ddp_single_process`` restores the tutorial's wrap.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Net(nn.Module):
    """pytorch/examples/mnist's network, unchanged."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


class StepClock:
    """Benchmark instrumentation (not part of the recipe), shared with accelerate_example.py.

    Per-step wall times, the time blocked on the loader's next batch, and training-loop seconds
    per epoch; ``perf_counter`` only, plus one device sync per epoch on CUDA.

        clock.start_epoch(); for batch in loader: clock.got_batch(); ...train...; clock.step_done()
        clock.end_epoch(cuda)
    """

    def __init__(self):
        self.steps, self.train_seconds, self.data_wait = 0, 0.0, 0.0
        self.step_times: list[float] = []

    def start_epoch(self) -> None:
        self._epoch_start = self._tick = time.perf_counter()

    def got_batch(self) -> None:
        self._got = time.perf_counter()

    def step_done(self) -> None:
        now = time.perf_counter()
        self.steps += 1
        self.step_times.append(now - self._tick)
        self.data_wait += self._got - self._tick
        self._tick = now

    def end_epoch(self, cuda: bool) -> None:
        if cuda:
            torch.cuda.synchronize()
        self.train_seconds += time.perf_counter() - self._epoch_start

    def results(self, world_size: int, global_batch: int, evals: list[dict]) -> dict:
        """What --results_json holds: throughput, data-wait share, every step time, the evaluations."""
        return {
            "world_size": world_size, "global_batch_size": global_batch, "optimizer_steps": self.steps,
            "train_seconds": self.train_seconds,
            "train_samples_per_sec": self.steps * global_batch / self.train_seconds,
            "data_wait_share": self.data_wait / max(sum(self.step_times), 1e-9),
            "step_times_ms": [round(1000 * t, 3) for t in self.step_times],
            "evals": evals,
            "eval_accuracy": evals[-1]["eval_accuracy"] if evals else None,
        }


def test(model, device, test_loader):
    """examples/mnist's test(), with the per-rank counts summed over ranks (DistributedSampler shards)."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            sums[0] += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            sums[1] += pred.eq(target.view_as(pred)).sum().item()
            sums[2] += len(data)
    dist.all_reduce(sums)
    return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST, DistributedDataParallel (textbook recipe)")
    parser.add_argument("--data_dir", default="../data", help="torchvision MNIST root (holds MNIST/raw)")
    parser.add_argument("--batch_size", type=int, default=64, help="input batch size per process (default: 64)")
    parser.add_argument("--test_batch_size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta learning rate (default: 1.0)")
    parser.add_argument("--gamma", type=float, default=0.7, help="StepLR decay per epoch (default: 0.7)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log_interval", type=int, default=10)
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--save_path", default="mnist_cnn.pt")
    # benchmark instrumentation
    parser.add_argument("--max_steps", type=int, default=None)
    parser.add_argument("--train_limit", type=int, default=None, help="train on the first N images")
    parser.add_argument("--eval_from", type=int, default=None, help="evaluate on test images [N:]")
    parser.add_argument("--stop_at_accuracy", type=float, default=None)
    parser.add_argument("--results_json", default=None)
    parser.add_argument("--metrics_jsonl", default=None)
    parser.add_argument("--ddp_single_process", action="store_true",
                        help="wrap in DDP even with one process (the tutorial; Accelerate does not)")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    torch.manual_seed(args.seed)

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_set = datasets.MNIST(args.data_dir, train=True, transform=transform)
    test_set = datasets.MNIST(args.data_dir, train=False, transform=transform)
    if args.train_limit is not None:
        train_set = Subset(train_set, range(args.train_limit))
    if args.eval_from is not None:
        test_set = Subset(test_set, range(args.eval_from, len(test_set)))
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader_kwargs = {"num_workers": args.num_workers, "pin_memory": use_cuda}
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, **loader_kwargs)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size,
                             sampler=DistributedSampler(test_set, shuffle=False), **loader_kwargs)

    net = Net().to(device)
    wrap = world_size > 1 or args.ddp_single_process  # as Accelerate: no DDP for a world of one
    model = DDP(net, device_ids=[local_rank] if use_cuda else None) if wrap else net
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    clock = StepClock()
    evals: list[dict] = []
    metrics = open(args.metrics_jsonl, "a") if (args.metrics_jsonl and rank == 0) else None
    done = False
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        clock.start_epoch()
        for batch_idx, (data, target) in enumerate(train_loader):
            clock.got_batch()
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and rank == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data) * world_size}/{len(train_sampler) * world_size}]"
                      f"\tLoss: {loss.item():.6f}", flush=True)
            clock.step_done()
            if args.max_steps is not None and clock.steps >= args.max_steps:
                done = True
                break
        clock.end_epoch(use_cuda)
        scheduler.step()
        test_loss, accuracy = test(model, device, test_loader)
        record = {"time": time.time(), "epoch": epoch, "step": clock.steps, "eval_loss": test_loss,
                  "eval_accuracy": accuracy, "train_seconds": clock.train_seconds}
        evals.append(record)
        if rank == 0:
            print(f"Test set (epoch {epoch}): Average loss: {test_loss:.4f}, Accuracy: {100 * accuracy:.2f}%",
                  flush=True)
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
        if done or (args.stop_at_accuracy is not None and accuracy >= args.stop_at_accuracy):
            break

    if rank == 0:
        torch.save(net.state_dict(), args.save_path)
        if args.results_json:
            with open(args.results_json, "w") as fh:
                json.dump(clock.results(world_size, args.batch_size * world_size, evals), fh)
    if metrics is not None:
        metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
