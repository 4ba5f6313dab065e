"""Text for the text tasks, made offline: a tiny GPT-2, token sequences, templated reviews and a word tokenizer.

``build_sequences`` and ``build_gpt`` are importable as ``tests.helpers.text:NAME`` (``--dataset``, ``--model``).
Transformers is imported where it is used (and its GPT-2 modelling preloaded here, for the forked ranks): a test
module that needs it skips without it (``importorskip``).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 48


def _load_gpt2_here() -> None:
    """Import Transformers' GPT-2 modelling in the test process, once, when a text test module imports this one:
    the ranks it forks inherit it instead of each importing it (~2.5 s a rank, on every run; under pytest-xdist,
    in a worker where no earlier test had imported it, 35 s for the four runs of one test). Without Transformers
    nothing happens here: the test modules that need it skip (``importorskip``)."""
    try:
        import transformers

        transformers.GPT2LMHeadModel, transformers.GPT2ForSequenceClassification  # noqa: B018 - the access imports
    except ImportError:
        pass


def _build_weight_conversions_here() -> None:
    """Build Transformers' table of checkpoint key conversions in the test process, once: the ranks it forks inherit
    it. ``from_pretrained`` and ``save_pretrained`` (a run's hf_model/ export) look a model up in it, and the first
    look-up in a process builds it for every architecture (``conversion_mapping._build_checkpoint_conversion_mapping``:
    ~1,200 weight renamings, each compiling its regular expressions, more than ``re``'s cache holds): ~0.13 s of CPU
    per rank of every run that loads or exports a Transformers model. It is a module global that no run changes
    (``register_checkpoint_conversion_mapping`` adds to it; nothing here calls it). Versions without it: nothing."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return
    get_checkpoint_conversion_mapping("gpt2")


_load_gpt2_here()
_build_weight_conversions_here()


def tiny_gpt(vocab: int = VOCAB, positions: int = 32, dropout: float = 0.0, activation: str = "gelu_new"):
    """A two-layer GPT-2 (``GPT2LMHeadModel``) small enough for a CPU test step in milliseconds."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=vocab, n_positions=positions,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=1, eos_token_id=1,
                        activation_function=activation)
    return GPT2LMHeadModel(config)


class Sequences(torch.utils.data.Dataset):
    """Token sequences of 3 to 16 tokens: samples are dicts {"input_ids": 1-D tensor}."""

    def __init__(self, count: int, seed: int = 0, min_len: int = 3, max_len: int = 16):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator)
        self.rows = [torch.randint(2, VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index]}


POSITIVE, NEGATIVE = ("good", "great", "nice", "fine", "lovely"), ("bad", "awful", "poor", "sad", "ugly")
SUBJECTS = ("the movie", "the food", "this book", "our trip", "the music", "that game")


def sentences(count: int, seed: int) -> list[tuple[str, str]]:
    """Templated reviews, labelled pos or neg by the adjectives they use."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        positive = bool(torch.randint(0, 2, (), generator=generator))
        words = POSITIVE if positive else NEGATIVE
        clauses = int(torch.randint(1, 4, (), generator=generator))
        parts = [f"{SUBJECTS[int(torch.randint(0, len(SUBJECTS), (), generator=generator))]} was "
                 f"{words[int(torch.randint(0, len(words), (), generator=generator))]}" for _ in range(clauses)]
        rows.append((" and ".join(parts) + " .", "pos" if positive else "neg"))
    return rows


def build_word_tokenizer(texts: list[str], folder: Path) -> Path:
    """A word-level tokenizer trained on ``texts`` (offline), saved as a Transformers tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                            eos_token="[EOS]").save_pretrained(str(folder))
    return folder


def lm_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    """A causal_lm run on the texts, tokenizer and gpt2.json of a corpus folder (tests/tasks' ``corpus``); a flag in
    ``extra`` replaces the default's (a flag given twice is said in a warning line)."""
    base = ["--task", "causal_lm", "--dataset", "hf", "--data_dir", str(corpus / "texts"),
            "--tokenizer", str(corpus / "tokenizer"), "--model_config", str(corpus / "gpt2.json"),
            "--max_length", "32", "--global_batch_size", "16", "--lr", "3e-3", "--log_every", "5",
            "--output_dir", str(out)]
    pairs = [(flag, value) for flag, value in zip(base[::2], base[1::2], strict=True) if flag not in extra]
    return [*(arg for pair in pairs for arg in pair), *extra]


def build_sequences(data_dir, download):
    from accel_ddp.data import DatasetBundle

    return DatasetBundle(Sequences(64), Sequences(16, seed=1), num_classes=2, input_shape=(16,))


def build_gpt(num_classes, input_shape):
    """``--model tests.helpers.text:build_gpt``: a user builder returning a Transformers model."""
    return tiny_gpt()
