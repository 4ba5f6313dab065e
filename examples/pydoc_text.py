"""Real text on every machine, offline: the Python Language Reference that CPython ships (``pydoc_data.topics``).

Two datasets for the text tasks, plus a tokenizer trained on them (nothing is downloaded):

    python examples/pydoc_text.py lm --out data/pydoc_lm          # train.jsonl, test.jsonl, tokenizer/
    python examples/pydoc_text.py topics --out data/pydoc_topics  # train.csv, test.csv (text, topic)

``lm``: every distinct paragraph of the reference (about 1,600 paragraphs, 356 kB on Python 3.11), a
tenth held out by a hash of its text (so a paragraph repeated under several topics never sits on
both sides), and a byte-level BPE tokenizer trained on the training paragraphs. Then train a tiny
GPT-2 from ``examples/configs/tiny_gpt2.json`` on it (see docs/tasks.md for the figures):

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train.py --task causal_lm \\
        --dataset hf --data_dir data/pydoc_lm --tokenizer data/pydoc_lm/tokenizer \\
        --model_config examples/configs/tiny_gpt2.json --packing --max_length 128 \\
        --global_batch_size 32 --epochs 12 --lr 2e-3 --warmup_steps 20 --output_dir outputs/pydoc_lm

``topics``: the paragraphs of six reference topics (pdb, string methods, sequence types, format
strings, dicts, comparisons) labelled by topic: a text classification set. Fine-tune the language
model above on it (its ``hf_model/`` folder holds the tokenizer too):

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train.py --task sequence_classification \\
        --dataset hf --data_dir data/pydoc_topics --label_column topic --model outputs/pydoc_lm/hf_model \\
        --max_length 128 --global_batch_size 16 --epochs 6 --lr 1e-3 --output_dir outputs/pydoc_topics
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import zlib

TOPICS = ("debugger", "string-methods", "typesseq", "formatstrings", "typesmapping", "comparisons")
EOS = "<|endoftext|>"


def paragraphs() -> dict[str, set[str]]:
    """Every distinct paragraph of the reference (over 40 characters) and the topics it appears under."""
    from pydoc_data.topics import topics

    found: dict[str, set[str]] = {}
    for name in sorted(topics):
        for paragraph in topics[name].split("\n\n"):
            paragraph = paragraph.strip()
            if len(paragraph) > 40:
                found.setdefault(paragraph, set()).add(name)
    return found


def held_out(text: str, tenths: int = 1) -> bool:
    """A fixed split by content: the same on every machine and Python run (unlike ``hash``)."""
    return zlib.crc32(text.encode("utf-8")) % 10 < tenths


def train_tokenizer(texts: list[str], folder: str, vocab_size: int) -> None:
    """A byte-level BPE (GPT-2's scheme) trained on ``texts``, saved as a Transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS).save_pretrained(folder)


def write_lm(out: str, vocab_size: int = 2048) -> dict[str, int]:
    """``out/train.jsonl``, ``out/test.jsonl`` ({"text": paragraph}) and ``out/tokenizer``; returns the counts."""
    os.makedirs(out, exist_ok=True)
    splits: dict[str, list[str]] = {"train": [], "test": []}
    for paragraph in paragraphs():
        splits["test" if held_out(paragraph) else "train"].append(paragraph)
    for split, rows in splits.items():
        with open(os.path.join(out, f"{split}.jsonl"), "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"text": text}) + "\n" for text in rows)
    train_tokenizer(splits["train"], os.path.join(out, "tokenizer"), vocab_size)
    return {split: len(rows) for split, rows in splits.items()}


def write_topics(out: str, topics: tuple[str, ...] = TOPICS) -> dict[str, int]:
    """``out/train.csv``, ``out/test.csv`` (text, topic): paragraphs found under exactly one of ``topics``."""
    os.makedirs(out, exist_ok=True)
    rows = {"train": [], "test": []}
    for paragraph, names in paragraphs().items():
        mine = names & set(topics)
        if len(mine) == 1:
            rows["test" if held_out(paragraph, tenths=2) else "train"].append((paragraph, mine.pop()))
    for split, split_rows in rows.items():
        with open(os.path.join(out, f"{split}.csv"), "w", newline="", encoding="utf-8") as fh:
            csv.writer(fh).writerows([("text", "topic"), *split_rows])
    return {split: len(split_rows) for split, split_rows in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", choices=("lm", "topics"))
    parser.add_argument("--out", required=True, help="folder to write the dataset (and tokenizer) into")
    parser.add_argument("--vocab_size", type=int, default=2048, help="lm: BPE vocabulary size")
    args = parser.parse_args()
    counts = write_lm(args.out, args.vocab_size) if args.dataset == "lm" else write_topics(args.out)
    print(f"wrote {args.out}: {counts['train']} training and {counts['test']} test paragraphs")


if __name__ == "__main__":
    main()
