"""Text for the text tasks: a Hugging Face dataset's text column, tokenized once per machine, padded per batch.

    --task causal_lm --dataset hf --data_dir texts/ --text_column text --tokenizer tok/ [--packing]

The splits come from ``--hf_name`` or ``--data_dir`` exactly as for ``--dataset hf``
(:mod:`accel_ddp.data.hf`; without an eval split a fixed tenth of train is held out). The text
column is tokenized with ``datasets.map``, whose cache (next to the dataset's own cache files)
lets the machine's other ranks, and later runs, reuse the first rank's work: the loop builds the
data on each machine's first process first (``local_main_first``).

- ``sequence_classification``: ``input_ids`` truncated to ``--max_length``, and ``labels`` from
  ``--label_column`` (class ids, or names numbered in sorted order).
- ``causal_lm``: ``input_ids`` truncated to ``--max_length``; with ``--packing`` the texts are
  joined (an end-of-text token between them) and cut into blocks of exactly ``--max_length``.

Samples are dicts of 1-D tensors of different lengths; :class:`PadCollate` pads each batch to
its longest sample and adds the ``attention_mask``. Packed blocks that fit in memory (``--device_loader_max_mb``
and this machine's budget, as a decoded image set) are read out of the datasets cache once into
:class:`~accel_ddp.data.in_memory.TokenBlocks`, which the device loader serves with no DataLoader
worker, no per-batch Arrow read and no collate; larger ones stay memory-mapped.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

from accel_ddp.data.bundle import DatasetBundle
from accel_ddp.data.hf import HFSource, label_column_of, load_splits, split_labels
from accel_ddp.data.hf_source import bad_text_named
from accel_ddp.data.in_memory import TokenBlocks
from accel_ddp.data.memory_budget import say
from accel_ddp.data.text_cache import (
    FACTS,
    cache_key,
    has_entry,
    read_blocks,
    tokenizer_digest,
    tokenizer_facts,
    tokenizer_files_digest,
    write_blocks,
)
from accel_ddp.util.messages import note
from accel_ddp.util.optional import import_quietly, require
from accel_ddp.util.validation import ConfigError

DEFAULT_TEXT_COLUMN = "text"
LABEL_PAD = -100  # padded label positions count for nothing in the loss (accel_ddp.tasks.protocol.IGNORE_INDEX)
MAP_BATCH = 1000  # texts per datasets.map batch: packing drops each batch's tail, so the blocks depend on it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")


class TextOptions(NamedTuple):
    """How text becomes token ids (``--text_column``, ``--tokenizer``, ``--max_length``, ``--packing``)."""

    tokenizer: str  # a folder written by save_pretrained, or a Hub name
    text_column: str | None = None  # None: "text"
    max_length: int = 512
    packing: bool = False
    labels: bool = True  # sequence_classification: a label per text; causal_lm: the tokens are the labels
    cache_dir: str | None = None  # causal_lm --packing with --data_dir: the packed blocks' cache (text_cache.py)
    cache_write: bool = True  # this process writes a missing entry (one per machine: the local main process)


class PadCollate:
    """A batch from samples: dict samples padded to the batch's longest, other samples as ``default_collate``.

    Sequence keys are padded on the right: ``labels`` with -100 (ignored by the loss),
    ``attention_mask`` with 0, anything else with ``pad_token_id``. An ``attention_mask`` is added
    where the samples have ``input_ids`` and none. Scalars (a class label) are stacked.

        >>> PadCollate(0)([{"input_ids": torch.tensor([5, 6])}, {"input_ids": torch.tensor([7])}])["attention_mask"]
        tensor([[1, 1],
                [1, 0]])
    """

    def __init__(self, pad_token_id: int = 0):
        self.pad_token_id = pad_token_id

    def __call__(self, samples: Sequence[Any]) -> Any:
        if not isinstance(samples[0], Mapping):
            return default_collate(samples)
        batch = {}
        for key in samples[0]:
            values = [torch.as_tensor(sample[key]) for sample in samples]
            if values[0].ndim == 0:
                batch[key] = torch.stack(values)
            else:
                pad = LABEL_PAD if key == "labels" else 0 if key == "attention_mask" else self.pad_token_id
                batch[key] = pad_sequence(values, batch_first=True, padding_value=pad)
        if "input_ids" in batch and "attention_mask" not in batch and batch["input_ids"].ndim == 2:
            lengths = torch.tensor([len(sample["input_ids"]) for sample in samples])
            batch["attention_mask"] = (torch.arange(batch["input_ids"].shape[1]) < lengths[:, None]).long()
        return batch


def pad_token_id(tokenizer: Any) -> int:
    """The id to pad ``input_ids`` with: the tokenizer's pad token, else its end-of-text token, else 0."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0


def has_tokenizer(folder: str) -> bool:
    return os.path.isdir(folder) and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def load_tokenizer(name: str | None) -> Any:
    """``AutoTokenizer.from_pretrained`` of a local folder (or a Hub name, online or cached), as one clear error."""
    if name is None:
        raise ConfigError("text needs a tokenizer; give --tokenizer PATH (a folder written by "
                          "tokenizer.save_pretrained), or a --model folder that holds one")
    transformers = require("transformers", "--tokenizer")
    if not os.path.exists(name) and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise ConfigError(f"--tokenizer {name}: no such folder; give a folder written by tokenizer.save_pretrained")
    try:
        return transformers.AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError(f"--tokenizer {name}: no tokenizer folder there and no Hub tokenizer of that name in the "
                          f"local cache ({first}); give a folder written by tokenizer.save_pretrained") from None


def import_text_libraries(data_dir: str | None = None, source: HFSource | None = None,
                          options: TextOptions | None = None) -> None:
    """What ``build_text`` imports before it reads anything: nothing where the packed blocks of
    ``data_dir``/``source``/``options`` are in ``--text_cache`` under a tokenizer folder's key (the build reads two
    arrays and loads no tokenizer); else Transformers and its tokenizer classes (lazy attributes, imported on first
    access), then datasets unless the blocks are cached under a Hub tokenizer's key (~2 s of imports off the data
    phase of a waiting rank). No data read; a missing package is reported by the build."""
    if options is not None and _cached(data_dir, source, options, load=False):
        return
    import_quietly("transformers")
    transformers = sys.modules.get("transformers")
    try:
        if transformers is not None:
            transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast  # noqa: B018 - the access imports them
    except ImportError:  # without the tokenizers package: the build says so
        transformers = None
    if transformers is not None and options is not None and _cached(data_dir, source, options, load=True):
        return
    import_quietly("datasets")


def _cached(data_dir: str, source: HFSource, options: TextOptions, load: bool) -> bool:
    """Are these blocks in the cache (an entry with a manifest: read_blocks checks it)? ``load``: load a Hub
    tokenizer to key it (a folder's files key it without loading). False on any error: the build meets it again
    and says so."""
    try:
        if tokenizer_files_digest(options.tokenizer) is None and not load:
            return False
        key = _cache_key(data_dir, source, options, lambda: load_tokenizer(options.tokenizer))
    except (ConfigError, OSError, ValueError):
        return False
    return key is not None and has_entry(options.cache_dir, key)


class CachedTokenizer:
    """The tokenizer of a cache hit on a tokenizer folder, unloaded: its length and special token ids from the
    entry's manifest (what the model phase and the collate read), the real one loaded on first use of anything
    else (``save_pretrained`` beside the final model). Keyed by the folder's files, so the facts are the folder's."""

    def __init__(self, name: str, facts: dict[str, Any]):
        self._name, self._facts, self._loaded = name, facts, None

    def __len__(self) -> int:
        return int(self._facts["length"])

    def __getattr__(self, attr: str) -> Any:
        if attr in FACTS[1:]:
            return self._facts[attr]
        if attr.startswith("_"):  # copy and pickle probe these: not the tokenizer's
            raise AttributeError(attr)
        return getattr(self._real(), attr)

    def __call__(self, *args, **kwargs) -> Any:
        return self._real()(*args, **kwargs)

    def _real(self) -> Any:
        if self._loaded is None:
            self._loaded = load_tokenizer(self._name)
        return self._loaded

    def __repr__(self) -> str:
        return f"CachedTokenizer({self._name!r}, {self._facts})"


def build_text(data_dir: str, source: HFSource, options: TextOptions) -> tuple[DatasetBundle, Any]:
    """(bundle of tokenized train and eval sets, tokenizer). ``num_classes`` is the class count, or the vocabulary
    size for language modelling; ``input_shape`` is ``(max_length,)``."""
    loaded = []  # the tokenizer, once loaded: a hit on a tokenizer folder's key loads none

    def tokenizer_now():
        if not loaded:
            loaded.append(load_tokenizer(options.tokenizer))
            if options.labels:  # sequence_classification pads each batch
                _ensure_pad_token(loaded[0], options.tokenizer)
        return loaded[0]

    key = _cache_key(data_dir, source, options, tokenizer_now)
    cached = read_blocks(options.cache_dir, key) if key else None
    if cached is not None and _fits(cached.blocks, source):
        facts = cached.about.get("tokenizer_facts")
        if loaded or not isinstance(facts, dict) or set(facts) != set(FACTS):
            tokenizer = tokenizer_now()
        else:
            tokenizer = CachedTokenizer(options.tokenizer, facts)
        return DatasetBundle(*(TokenBlocks(t) for t in cached.blocks), len(tokenizer), (options.max_length,)), tokenizer
    tokenizer = tokenizer_now()
    require("datasets", "--dataset hf")
    train, eval_split = load_splits(data_dir, source)
    if eval_split is None:  # a fixed tenth of train, the same on every rank
        held_out = train.train_test_split(test_size=0.1, seed=0)
        train, eval_split = held_out["train"], held_out["test"]
    column = options.text_column or DEFAULT_TEXT_COLUMN
    if column not in train.column_names:
        raise ConfigError(f"hf: no text column {column!r}; the columns are {', '.join(train.column_names)}; "
                          "name the text with --text_column")
    with bad_text_named(data_dir, source):  # the texts and label names are read here, every row of them
        splits = [_tokenize(ds, tokenizer, column, options) for ds in (train, eval_split)]
        if options.labels:
            label_col = label_column_of(train, source.label_column)
            train_y, eval_y, num_classes = split_labels(train, eval_split, label_col)
            splits = [ds.add_column("labels", y.tolist()) for ds, y in zip(splits, (train_y, eval_y), strict=True)]
        else:
            num_classes = len(tokenizer)
    if not options.packing and not options.labels:
        _say_short_texts_left_out(splits[0], len(train), source.name or data_dir, options.max_length)
    for name, ds in zip(("train", "eval"), splits, strict=True):
        if options.packing and len(ds) == 0:  # every text of the split together is shorter than one block
            raise ConfigError(f"--packing: the texts of the {name} split of {source.name or data_dir} make no whole "
                              f"block of --max_length {options.max_length} tokens; lower --max_length, or give "
                              "it more text")
    held = _blocks_in_memory(splits, options.max_length, source) if options.packing and not options.labels else None
    if key and held is not None and options.cache_write:
        write_blocks(options.cache_dir, key, tuple(blocks.inputs for blocks in held),
                     {"data_dir": os.path.abspath(data_dir), "tokenizer": options.tokenizer,
                      "max_length": options.max_length, "tokenizer_facts": tokenizer_facts(tokenizer)})
    train_set, eval_set = held or (ds.with_format("torch") for ds in splits)
    return DatasetBundle(train_set, eval_set, num_classes, (options.max_length,)), tokenizer


def _say_short_texts_left_out(tokenized, texts: int, name: str, max_length: int) -> None:
    """causal_lm without --packing: the texts of fewer than 2 tokens were left out (``_tokenize_batch``); none left
    is bad input, some left out one note."""
    if len(tokenized) == 0:
        raise ConfigError(f"--task causal_lm: every one of the {texts} training texts of {name} is empty or a single "
                          "token, so there is no next token to predict; give it texts, check --text_column, or add "
                          "--packing to join short texts into blocks")
    if len(tokenized) < texts:
        note(f"--task causal_lm: {texts - len(tokenized)} of the {texts} training texts of {name} are empty or a "
             f"single token (nothing to predict) and are left out; --packing joins texts into blocks of "
             f"--max_length {max_length}", ranks="main")


def _cache_key(data_dir: str, source: HFSource, options: TextOptions, tokenizer: Callable[[], Any]) -> str | None:
    """The packed blocks' cache key, or None where they are not cached: off, not packed causal_lm, a Hub dataset
    (its revision is the datasets cache's business), a stream, or no such --data_dir (the build says so).
    ``tokenizer()`` loads the tokenizer, called only where it is a Hub name (a folder is keyed by its files)."""
    if (options.cache_dir is None or not options.packing or options.labels or source.name is not None
            or source.streaming or not os.path.exists(data_dir)):
        return None
    settings = {"max_length": options.max_length, "text_column": options.text_column or DEFAULT_TEXT_COLUMN,
                "train_split": source.train_split, "eval_split": source.eval_split, "map_batch": MAP_BATCH,
                "held_out": (0.1, 0)}  # build_text's held-out tenth: test_size, seed
    return cache_key(data_dir, tokenizer_files_digest(options.tokenizer) or tokenizer_digest(tokenizer()), settings)


def _fits(blocks: tuple[torch.Tensor, ...], source: HFSource) -> bool:
    """Cached blocks are served from memory only where the budget allows them (else the memory-mapped path)."""
    nbytes = sum(t.numel() * t.element_size() for t in blocks)
    return source.in_memory_max_mb is None or nbytes <= source.in_memory_max_mb * 2**20


def _blocks_in_memory(splits, max_length: int, source: HFSource) -> tuple[TokenBlocks, TokenBlocks] | None:
    """The packed train and eval blocks as tensors in memory, or None (memory-mapped) when they do not fit
    ``source.in_memory_max_mb`` (the flag and this machine's budget; one line when the budget decides)."""
    nbytes = sum(len(ds) for ds in splits) * max_length * torch.empty((), dtype=torch.int64).element_size()
    if source.in_memory_max_mb is not None and nbytes > source.in_memory_max_mb * 2**20:
        if source.memory_limit is not None:
            say(source.memory_limit.note("the packed token blocks", nbytes, source.in_memory_max_mb))
        return None
    # One columnar read per split: the numpy format stacks the equal-length blocks into a fresh array, which the
    # tensor shares (copied only if it is not int64 and contiguous: no second copy at the peak).
    return tuple(TokenBlocks(torch.from_numpy(np.ascontiguousarray(ds.with_format("numpy")[:]["input_ids"],
                                                                   dtype=np.int64)))
                 for ds in splits)


def _ensure_pad_token(tokenizer, name: str) -> None:
    """A sequence classifier's batches are padded, and GPT-style classifiers find each text's last token by the
    pad token (Transformers' GPT2ForSequenceClassification refuses a batch without one). A tokenizer without a
    pad token pads with its end-of-text token, as Transformers users do (``tokenizer.pad_token =
    tokenizer.eos_token``); the model's ``pad_token_id`` follows the tokenizer (models.build_transformers_model)."""
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token is None:
        raise ConfigError(f"--tokenizer {name} has no pad token and no end-of-text token, and sequence "
                          "classification pads its batches; add one (tokenizer.add_special_tokens({'pad_token': "
                          "'[PAD]'}), then save_pretrained) and use that folder")
    tokenizer.pad_token = tokenizer.eos_token
    note(f"--tokenizer {name} has no pad token; padding with its end-of-text token {tokenizer.eos_token!r} "
         "(tokenizer.pad_token = tokenizer.eos_token, the usual choice for GPT-style models)",
         ranks="first")  # every rank loads the tokenizer; one note


def _tokenize(ds, tokenizer, column: str, options: TextOptions):
    """One ``datasets.map`` (cached): every text to ``input_ids``; packed into blocks with ``--packing``."""
    return ds.map(
        _tokenize_batch, batched=True, batch_size=MAP_BATCH, remove_columns=ds.column_names, desc="tokenizing",
        fn_kwargs={"tokenizer": tokenizer, "column": column, "max_length": options.max_length,
                   "packing": options.packing, "drop_short": not options.labels},
    )


def _tokenize_batch(batch: dict[str, list], tokenizer, column: str, max_length: int, packing: bool,
                    drop_short: bool = False) -> dict:
    """``drop_short`` (causal_lm without packing): a text of fewer than 2 tokens has no next token to predict, and
    a batch of only such texts has no tokens at all (GPT-2's ``cannot reshape tensor of 0 elements``): left out."""
    texts = [text if isinstance(text, str) else "" for text in batch[column]]
    if not packing:
        ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
        return {"input_ids": [row for row in ids if len(row) >= 2] if drop_short else ids}
    # Join the texts of this map batch (an end-of-text token after each) and cut whole blocks; the tail of a
    # batch shorter than a block is dropped, as in Transformers' run_clm.py.
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream = [token for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for token in ids + eos]
    usable = len(stream) // max_length * max_length
    return {"input_ids": [stream[i:i + max_length] for i in range(0, usable, max_length)]}
