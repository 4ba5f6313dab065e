"""(b) The textbook MNIST loop on Accelerate, written as Accelerate's example scripts write it.

Shaped like ``accelerate/examples/cv_example.py`` and ``nlp_example.py``: a ``training_function(config,
args)``, ``Accelerator(cpu=args.cpu, mixed_precision=...)``, ``set_seed``, plain DataLoaders with
``shuffle=True`` and a per-device ``batch_size`` that ``prepare`` shards, ``accelerator.backward``,
``gather_for_metrics`` in eval, ``accelerator.print``, and a final ``accelerator.save`` of the
unwrapped model's state dict after ``wait_for_everyone``. Model, data pipeline (torchvision MNIST,
PIL + ``ToTensor()`` + ``Normalize``) and optimizer (Adadelta lr 1.0, StepLR gamma 0.7) are those of
``textbook_ddp.py``.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml benchmarks/accelerate_example.py \
        --cpu --data_dir /tmp/mnist_root --batch_size 32

As in the examples, the scheduler goes through ``prepare``; Accelerate then steps it once per
process on each ``lr_scheduler.step()`` (it assumes a per-batch schedule), so this per-epoch
StepLR decays by gamma**num_processes per epoch. That is how the examples behave; it does not
change throughput, which is what this script is measured for.

Benchmark instrumentation (per-step wall times, DataLoader wait, ``--results_json``, ``--max_steps``,
``--train_limit``/``--eval_from``) is the same as in ``textbook_ddp.py``: kept apart from the loop's
logic and free of extra synchronisation on CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from textbook_ddp import Net, StepClock  # same folder: the launcher puts it on sys.path
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms

EVAL_BATCH_SIZE = 1000


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    set_seed(seed)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_dataset = datasets.MNIST(args.data_dir, train=True, transform=transform)
    eval_dataset = datasets.MNIST(args.data_dir, train=False, transform=transform)
    if args.train_limit is not None:
        train_dataset = Subset(train_dataset, range(args.train_limit))
    if args.eval_from is not None:
        eval_dataset = Subset(eval_dataset, range(args.eval_from, len(eval_dataset)))
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=batch_size, num_workers=args.num_workers)
    eval_dataloader = DataLoader(eval_dataset, shuffle=False, batch_size=EVAL_BATCH_SIZE,
                                 num_workers=args.num_workers)

    model = Net().to(accelerator.device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=lr)
    lr_scheduler = StepLR(optimizer, step_size=1, gamma=config["gamma"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    clock = StepClock()  # benchmark instrumentation, not part of the example
    evals: list[dict] = []
    done = False
    for epoch in range(num_epochs):
        model.train()
        clock.start_epoch()
        for inputs, labels in train_dataloader:
            clock.got_batch()
            outputs = model(inputs)
            loss = F.nll_loss(outputs, labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            clock.step_done()
            if args.max_steps is not None and clock.steps >= args.max_steps:
                done = True
                break
        clock.end_epoch(accelerator.device.type == "cuda")
        lr_scheduler.step()

        model.eval()
        accurate, num_elems = 0, 0
        for inputs, labels in eval_dataloader:
            with torch.no_grad():
                outputs = model(inputs)
            predictions = outputs.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, labels))
            accurate_preds = predictions == references
            num_elems += accurate_preds.shape[0]
            accurate += accurate_preds.long().sum()
        eval_metric = accurate.item() / num_elems
        evals.append({"time": time.time(), "epoch": epoch, "step": clock.steps, "eval_accuracy": eval_metric,
                      "train_seconds": clock.train_seconds})
        accelerator.print(f"epoch {epoch}: {100 * eval_metric:.2f}")
        if done:
            break

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    accelerator.save(unwrapped_model.state_dict(), args.save_path)
    if accelerator.is_main_process and args.results_json:
        with open(args.results_json, "w") as fh:
            json.dump(clock.results(accelerator.num_processes, batch_size * accelerator.num_processes, evals), fh)
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="MNIST on Accelerate, as its example scripts are written.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--data_dir", default="../data", help="torchvision MNIST root (holds MNIST/raw)")
    parser.add_argument("--batch_size", type=int, default=64, help="per-device batch size")
    parser.add_argument("--num_epochs", type=int, default=14)
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--save_path", default="mnist_cnn.pt")
    parser.add_argument("--max_steps", type=int, default=None)
    parser.add_argument("--train_limit", type=int, default=None)
    parser.add_argument("--eval_from", type=int, default=None)
    parser.add_argument("--results_json", default=None)
    args = parser.parse_args()
    config = {"lr": 1.0, "gamma": 0.7, "num_epochs": args.num_epochs, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
