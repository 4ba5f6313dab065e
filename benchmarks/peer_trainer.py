"""The Hugging Face Trainer on the causal-LM work of ``peers.py``, written as its docs write it.

Transformers' ``run_clm.py`` recipe: ``load_dataset("json", ...)`` on the folder ``examples/pydoc_text.py lm``
wrote, the tokenizer mapped over the texts, ``group_texts`` joining them and cutting blocks of
``--block_size`` tokens (labels a copy of ``input_ids``), a GPT-2 from ``examples/configs/tiny_gpt2.json``,
``Trainer(...).train()`` and an evaluation after each epoch. Settings that define the work are set to
accel_ddp's (learning rate, warmup, cosine schedule, per-device batch, epochs, clipping, no weight decay);
everything else is the Trainer's default, its optimizer included: ``adamw_torch_fused``, the fused AdamW
accel_ddp also takes on the CPU and on CUDA.
Launched the way accel_ddp is (``accelerate launch``; the Trainer reads torchrun's environment):

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml benchmarks/peer_trainer.py \
        --data_dir DIR --epochs 3 --per_device_batch_size 16 --results_json /tmp/trainer.json

Timing as accel_ddp's ``EpochTimer``: per epoch, from its start to its last optimizer step, and the process's
CPU time over the same window (a ``TrainerCallback``); start-up from the process's start to the end of the
first optimizer step, the largest over the ranks (``common.slowest_rank``: on the GPU under NCCL).
``--mixed_precision bf16``: the Trainer's ``bf16=True``, matching accel_ddp's bf16 on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel_ddp.tracking.startup import process_age  # noqa: E402
from benchmarks.common import exit_now, slowest_rank  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def blocks(data_dir: str, tokenizer, block_size: int):
    """run_clm.py's pipeline: tokenize, then join and cut (an end-of-text token after each text, as accel_ddp's
    ``--packing`` joins them; run_clm.py joins them without one)."""
    from datasets import load_dataset

    raw = load_dataset("json", data_files={"train": f"{data_dir}/train.jsonl", "test": f"{data_dir}/test.jsonl"})

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + [tokenizer.eos_token_id] for row in ids]}

    def group_texts(batch):
        joined = list(chain(*batch["input_ids"]))
        usable = len(joined) // block_size * block_size
        cut = [joined[i:i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": cut, "labels": [list(row) for row in cut]}

    tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
    return tokenized.map(group_texts, batched=True)


def main() -> None:
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir", required=True, help="the folder examples/pydoc_text.py lm wrote")
    p.add_argument("--model_config", default=str(REPO / "examples" / "configs" / "tiny_gpt2.json"))
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--per_device_batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixed_precision", choices=("no", "bf16"), default="no",
                   help="bf16: the Trainer's bf16=True (autocast), as accel_ddp's side runs on a GPU")
    p.add_argument("--results_json", required=True)
    args = p.parse_args()
    started = time.perf_counter() - (process_age() or 0.0)

    tokenizer = AutoTokenizer.from_pretrained(f"{args.data_dir}/tokenizer")
    data = blocks(args.data_dir, tokenizer, args.block_size)
    config = AutoConfig.from_pretrained(args.model_config, vocab_size=len(tokenizer),
                                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)

    class EpochClock(TrainerCallback):
        """accel_ddp's EpochTimer window: an epoch's start to its last optimizer step."""

        def __init__(self):
            self.epochs, self.first_step_at = [], None

        def on_epoch_begin(self, *_, **__):
            self.begin, self.cpu, self.steps = time.perf_counter(), time.process_time(), 0

        def on_step_end(self, *_, **__):
            self.steps += 1
            self.last, self.last_cpu = time.perf_counter(), time.process_time()
            self.first_step_at = self.first_step_at or self.last

        def on_epoch_end(self, *_, **__):
            self.epochs.append({"steps": self.steps, "seconds": self.last - self.begin,
                                "cpu_seconds": self.last_cpu - self.cpu})

    clock = EpochClock()
    with tempfile.TemporaryDirectory(prefix="peer_trainer_") as out:
        training_args = TrainingArguments(
            output_dir=out, num_train_epochs=args.epochs, per_device_train_batch_size=args.per_device_batch_size,
            per_device_eval_batch_size=args.per_device_batch_size, learning_rate=args.lr,
            warmup_steps=args.warmup_steps, lr_scheduler_type="cosine", max_grad_norm=1.0, weight_decay=0.0,
            eval_strategy="epoch", save_strategy="no", report_to="none", disable_tqdm=True,
            dataloader_drop_last=True, seed=args.seed,  # drop_last: accel_ddp's steps per epoch (whole batches)
            # Without use_cpu, the Trainer under torchrun on a machine without a GPU trains one independent
            # model per process (parallel_mode NOT_PARALLEL: every rank reads every block, no all-reduce;
            # transformers 5.24, seen here). The Trainer's docs name use_cpu for CPU training.
            use_cpu=not torch.cuda.is_available(), bf16=args.mixed_precision == "bf16")
        trainer = Trainer(model=model, args=training_args, train_dataset=data["train"], eval_dataset=data["test"],
                          data_collator=default_data_collator, callbacks=[clock])
        trainer.train()
    eval_loss = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r][-1]  # the last epoch's
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside Accelerate's wrapper
    startup, rank_zero = slowest_rank(clock.first_step_at - started)
    if rank_zero:
        Path(args.results_json).write_text(json.dumps({
            "epochs": clock.epochs, "startup_sec": startup, "eval_loss": eval_loss,
            "samples_per_step": args.per_device_batch_size * training_args.world_size,
            "mixed_precision": args.mixed_precision, "device": str(training_args.device),
            "train_blocks": len(data["train"]), "optimizer": type(optimizer).__name__,
            "optimizer_kernels": {k: v for k, v in optimizer.defaults.items() if k in ("foreach", "fused")},
        }))


if __name__ == "__main__":
    main()
    exit_now()  # past the gloo teardown race at finalization (common.exit_now)
