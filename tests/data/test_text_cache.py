"""--text_cache: the packed blocks of causal_lm read back on a second run, keyed by data, tokenizer and settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.helpers.multiproc import run_ranks  # noqa: E402
from tests.helpers.text import build_word_tokenizer, sentences  # noqa: E402


@pytest.fixture
def texts(tmp_path, monkeypatch) -> Path:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    folder = tmp_path / "texts"
    folder.mkdir()
    for split, seed in (("train", 0), ("test", 1)):
        (folder / f"{split}.json").write_text("".join(f'{{"text": "{t}"}}\n' for t, _ in sentences(60, seed)))
    build_word_tokenizer([t for t, _ in sentences(60, 0)], tmp_path / "tok")
    return folder


class Counted:
    """Counts what a build does: tokenizer calls (text._tokenize_batch) and data reads (text.load_splits)."""

    def __init__(self, monkeypatch):
        import accel_ddp.data.text as text

        self.tokenize = self.loads = 0
        tokenize, load = text._tokenize_batch, text.load_splits

        def counted_tokenize(*args, **kwargs):
            self.tokenize += 1
            return tokenize(*args, **kwargs)

        def counted_load(*args, **kwargs):
            self.loads += 1
            return load(*args, **kwargs)

        monkeypatch.setattr(text, "_tokenize_batch", counted_tokenize)
        monkeypatch.setattr(text, "load_splits", counted_load)


def build(texts: Path, cache: Path, max_length: int = 16, cache_dir: str | None = "default", with_tokenizer=False):
    from accel_ddp.data.hf import HFSource
    from accel_ddp.data.text import TextOptions, build_text

    options = TextOptions(str(texts.parent / "tok"), max_length=max_length, packing=True, labels=False,
                          cache_dir=str(cache) if cache_dir == "default" else cache_dir)
    bundle, tokenizer = build_text(str(texts), HFSource(in_memory_max_mb=64.0), options)
    return (bundle, tokenizer) if with_tokenizer else bundle


def no_tokenizer_loads(monkeypatch) -> None:
    """AutoTokenizer.from_pretrained fails the test from here on."""
    import transformers

    def refused(*args, **kwargs):
        raise AssertionError("a tokenizer was loaded")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refused)


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if not p.name.startswith(".")) if cache.exists() else []


def test_a_second_run_reads_the_blocks_from_the_cache_without_reading_or_tokenizing_the_texts(
        texts, tmp_path, monkeypatch):
    from accel_ddp.data.in_memory import TokenBlocks

    cache = tmp_path / "blocks"
    first = build(texts, cache)
    (texts / "cache-0123abcd.arrow").write_bytes(b"datasets' own")  # what map writes beside save_to_disk data
    counts = Counted(monkeypatch)
    second = build(texts, cache)
    assert (counts.tokenize, counts.loads) == (0, 0)
    assert isinstance(second.train, TokenBlocks) and isinstance(second.eval, TokenBlocks)
    assert torch.equal(first.train.inputs, second.train.inputs) and torch.equal(first.eval.inputs, second.eval.inputs)
    assert (second.num_classes, second.input_shape) == (first.num_classes, first.input_shape)
    assert len(entries(cache)) == 1
    (texts / "cache-0123abcd.arrow").unlink()  # not an Arrow file: the build below would read it as data
    # off: every run tokenizes again
    build(texts, cache, cache_dir=None)
    assert counts.tokenize > 0 and counts.loads == 1


def test_a_changed_data_file_block_size_or_tokenizer_is_a_new_entry_never_a_stale_read(texts, tmp_path, monkeypatch):
    cache = tmp_path / "blocks"
    first = build(texts, cache)
    counts = Counted(monkeypatch)
    with open(texts / "train.json", "a") as fh:  # one more text
        fh.write('{"text": "the movie was good and the food was great ."}\n')
    grown = build(texts, cache)
    assert counts.loads == 1 and len(grown.train) >= len(first.train) and len(entries(cache)) == 2
    longer = build(texts, cache, max_length=24)
    assert counts.loads == 2 and longer.train.inputs.shape[1] == 24 and len(entries(cache)) == 3
    build_word_tokenizer([t for t, _ in sentences(30, 5)], texts.parent / "tok")  # another vocabulary
    build(texts, cache)
    assert counts.loads == 3 and len(entries(cache)) == 4


def test_a_corrupt_entry_is_rebuilt_with_one_line(texts, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "blocks"
    first = build(texts, cache)
    (entry,) = entries(cache)
    data = bytearray((entry / "train.npy").read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the digest shows it
    (entry / "train.npy").write_bytes(bytes(data))
    capsys.readouterr()
    counts = Counted(monkeypatch)
    again = build(texts, cache)
    lines = [line for line in capsys.readouterr().err.splitlines() if "--text_cache" in line]
    assert len(lines) == 1 and "damaged" in lines[0] and "sha256" in lines[0] and "rebuilding" in lines[0], lines
    assert counts.loads == 1 and torch.equal(again.train.inputs, first.train.inputs)
    counts.loads = 0
    (entry / "eval.npy").write_bytes(b"short")  # truncated: the byte count shows it
    build(texts, cache)
    assert counts.loads == 1 and "bytes" in capsys.readouterr().err
    counts.loads = 0
    build(texts, cache)  # rewritten whole: a hit again
    assert counts.loads == 0 and entries(cache) == [entry]


def test_every_rank_reads_the_same_blocks_and_only_the_first_process_writes_the_cache(texts, tmp_path):
    """Two forked ranks of one machine through resolve_data: rank 0 builds and writes the entry (local_main_first),
    rank 1 waits, then reads it: no tokenizing on rank 1, one writer, the same blocks on both. A second run (warm
    cache): neither rank loads a tokenizer, and both get the same blocks and vocabulary size."""
    cache = tmp_path / "blocks"

    def run():
        import transformers
        from accelerate import Accelerator

        import accel_ddp.data.text as text
        from accel_ddp.cli.args import parse_args
        from accel_ddp.config.views import section_of
        from accel_ddp.data.resolve import DataOptions, resolve_data

        writes, tokenized, loads = [], [], []
        write, tokenize, load = text.write_blocks, text._tokenize_batch, transformers.AutoTokenizer.from_pretrained
        text.write_blocks = lambda *a, **k: (writes.append(1), write(*a, **k))[1]
        text._tokenize_batch = lambda *a, **k: (tokenized.append(1), tokenize(*a, **k))[1]
        transformers.AutoTokenizer.from_pretrained = lambda *a, **k: (loads.append(1), load(*a, **k))[1]
        cfg = parse_args(["--task", "causal_lm", "--dataset", "hf", "--data_dir", str(texts), "--tokenizer",
                          str(texts.parent / "tok"), "--max_length", "16", "--packing", "--text_cache", str(cache)])
        data = resolve_data(section_of(cfg, DataOptions), Accelerator(cpu=True), None, None)
        return data.train.inputs, data.eval.inputs, len(writes), len(tokenized) > 0, len(loads), data.num_classes

    (train0, eval0, writes0, tokenized0, _, classes), (train1, eval1, writes1, tokenized1, _, _) = run_ranks(run)
    assert torch.equal(train0, train1) and torch.equal(eval0, eval1)
    assert (writes0, writes1) == (1, 0) and (tokenized0, tokenized1) == (True, False)
    assert len(entries(cache)) == 1 and not [p for p in cache.iterdir() if p.name.startswith(".tmp")]
    for train, eval_, writes, tokenized, loads, num_classes in run_ranks(run):
        assert torch.equal(train, train0) and torch.equal(eval_, eval0) and num_classes == classes
        assert (writes, tokenized, loads) == (0, False, 0)


def test_the_flag_off_and_its_default_folder(monkeypatch, tmp_path):
    from accel_ddp.data.text_cache import cache_root

    assert cache_root("off") is None
    monkeypatch.setenv("ACCEL_DDP_CACHE", str(tmp_path))
    assert cache_root(None) == str(tmp_path / "text_blocks")
    monkeypatch.delenv("ACCEL_DDP_CACHE")
    assert cache_root(None) == os.path.expanduser("~/.cache/accel_ddp/text_blocks")


def test_a_waiting_rank_skips_importing_datasets_where_the_blocks_are_cached(texts, tmp_path, monkeypatch):
    """import_text_libraries (run by a rank while its machine's first process builds): datasets only on a miss."""
    import accel_ddp.data.text as text
    from accel_ddp.data.hf import HFSource
    from accel_ddp.data.text import TextOptions

    cache = tmp_path / "blocks"
    imported = []
    monkeypatch.setattr(text, "import_quietly", lambda *names: imported.extend(names))
    options = TextOptions(str(texts.parent / "tok"), max_length=16, packing=True, labels=False, cache_dir=str(cache))
    text.import_text_libraries(str(texts), HFSource(in_memory_max_mb=64.0), options)
    assert imported == ["transformers", "datasets"]
    build(texts, cache)
    imported.clear()
    no_tokenizer_loads(monkeypatch)  # the tokenizer folder's files key the entry: nothing to load or import
    text.import_text_libraries(str(texts), HFSource(in_memory_max_mb=64.0), options)
    assert imported == []


def test_a_hit_loads_no_tokenizer_and_the_run_gets_the_same_blocks_and_tokenizer_facts(texts, tmp_path, monkeypatch):
    """The key is read from the tokenizer folder's files; what the run reads from the tokenizer (its length, the
    pad, end-of-text and start ids: model config, collate) comes from the manifest; anything else loads it."""
    from accel_ddp.data.resolve import PadCollate, pad_token_id
    from accel_ddp.data.text import CachedTokenizer
    from accel_ddp.models import build_transformers_model

    cache = tmp_path / "blocks"
    first, real = build(texts, cache, with_tokenizer=True)
    config = tmp_path / "gpt2.json"
    config.write_text('{"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 16}')
    with monkeypatch.context() as patched:
        no_tokenizer_loads(patched)  # the data, the collate and the model from a config: no tokenizer loaded
        second, lazy = build(texts, cache, with_tokenizer=True)
        configs = [build_transformers_model("causal_lm", config_file=str(config), tokenizer=tok).config
                   for tok in (real, lazy)]
        collates = [PadCollate(pad_token_id(tok)).pad_token_id for tok in (real, lazy)]
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            assert getattr(lazy, name) == getattr(real, name), name
    assert isinstance(lazy, CachedTokenizer)
    assert torch.equal(first.train.inputs, second.train.inputs) and torch.equal(first.eval.inputs, second.eval.inputs)
    assert (second.num_classes, second.input_shape) == (first.num_classes, first.input_shape) == (len(real), (16,))
    assert configs[0].to_dict() == configs[1].to_dict() and configs[1].vocab_size == len(real) and collates == [0, 0]
    lazy.save_pretrained(str(tmp_path / "saved"))  # beside the final model: the real one, loaded now
    saved = (tmp_path / "saved" / "tokenizer.json").read_bytes()
    assert saved == (texts.parent / "tok" / "tokenizer.json").read_bytes()
    assert lazy("the food was good")["input_ids"] == real("the food was good")["input_ids"]


def test_an_edited_tokenizer_file_or_another_tokenizers_version_is_a_new_key(texts, tmp_path, monkeypatch):
    import accel_ddp.data.text_cache as text_cache

    cache = tmp_path / "blocks"
    build(texts, cache)
    folder = texts.parent / "tok"
    before = text_cache.tokenizer_files_digest(str(folder))
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"[EOS]"', '"[PAD]"', 1))  # another end-of-text token
    assert text_cache.tokenizer_files_digest(str(folder)) != before
    counts = Counted(monkeypatch)
    bundle, tokenizer = build(texts, cache, with_tokenizer=True)
    assert counts.loads == 1 and len(entries(cache)) == 2 and tokenizer.eos_token_id == 0
    (folder / "model.safetensors").write_bytes(b"weights")  # not a tokenizer file: the same key
    build(texts, cache)
    assert counts.loads == 1 and len(entries(cache)) == 2
    version = text_cache._version
    monkeypatch.setattr(text_cache, "_version", lambda package: "0.0" if package == "tokenizers" else version(package))
    build(texts, cache)
    assert counts.loads == 2 and len(entries(cache)) == 3
    assert text_cache.tokenizer_files_digest(str(tmp_path / "texts")) is None  # no tokenizer files: loaded to key it


# ----------------------------------------------------------------------------- a cache that cannot be written


def _two_ranks_build(texts: Path, cache: Path) -> list[int]:
    """resolve_data on two forked ranks of one machine with --text_cache ``cache``: each rank's training blocks."""
    def run():
        from accelerate import Accelerator

        from accel_ddp.cli.args import parse_args
        from accel_ddp.config.views import section_of
        from accel_ddp.data.resolve import DataOptions, resolve_data

        cfg = parse_args(["--task", "causal_lm", "--dataset", "hf", "--data_dir", str(texts), "--tokenizer",
                          str(texts.parent / "tok"), "--max_length", "16", "--packing", "--text_cache", str(cache)])
        return len(resolve_data(section_of(cfg, DataOptions), Accelerator(cpu=True), None, None).train)

    return run_ranks(run)


def cache_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "--text_cache" in line]


def test_a_regular_file_given_as_the_cache_is_told_so_once(texts, tmp_path, capfd):
    """Was "(File exists) ... free space there", from each rank: a file is not a folder, and nothing fills it."""
    cache = tmp_path / "blocks.txt"
    cache.write_text("my notes\n")
    capfd.readouterr()
    sizes = _two_ranks_build(texts, cache)
    lines = cache_lines(capfd.readouterr().err)
    assert sizes[0] == sizes[1] > 0
    assert len(lines) == 1, lines
    assert f"--text_cache {cache} is a file, not a folder" in lines[0] and "free space" not in lines[0], lines
    assert cache.read_text() == "my notes\n"


def test_a_read_only_cache_folder_is_told_so(texts, tmp_path, capfd, monkeypatch):
    """Was "free space there": a read-only folder (EROFS here; root ignores chmod) has no space to free."""
    import errno
    import tempfile

    import accel_ddp.data.text_cache as text_cache

    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(text_cache.tempfile, "mkdtemp", refused)
    capfd.readouterr()
    build(texts, tmp_path / "blocks")
    monkeypatch.setattr(text_cache.tempfile, "mkdtemp", tempfile.mkdtemp)
    lines = cache_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "it is read-only" in lines[0] and "free space" not in lines[0], lines
    assert "the next run tokenizes again; make it writable" in lines[0] and "or 'off'" in lines[0], lines


@pytest.mark.parametrize("how", ["numpy's own words", "ENOSPC"])
def test_a_full_disk_is_told_in_human_sizes(texts, tmp_path, capfd, monkeypatch, how):
    """Was numpy's "N requested and M written" (byte counts): the entry's size and the free space, in MiB/GiB."""
    import errno

    import accel_ddp.data.text_cache as text_cache

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if how == "ENOSPC" else OSError(
            "3145728 requested and 8192 written")

    monkeypatch.setattr(text_cache.np, "save", full)
    monkeypatch.setattr(text_cache, "free_bytes", lambda folder: 300 * 2**20)
    capfd.readouterr()
    build(texts, tmp_path / "blocks")
    lines = cache_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "the disk is full (needs " in lines[0] and ", 300.0 MiB free)" in lines[0], lines
    assert "requested" not in lines[0] and "free space there, or give another folder" in lines[0], lines
    assert not list((tmp_path / "blocks").glob(".tmp*")), "a half-written entry was left"


def test_an_entry_larger_than_the_free_space_is_not_started(texts, tmp_path, capfd, monkeypatch):
    import accel_ddp.data.text_cache as text_cache

    saves = []
    monkeypatch.setattr(text_cache.np, "save", lambda *args, **kwargs: saves.append(args))
    monkeypatch.setattr(text_cache, "free_bytes", lambda folder: 100)
    capfd.readouterr()
    build(texts, tmp_path / "blocks")
    lines = cache_lines(capfd.readouterr().err)
    assert saves == [] and len(lines) == 1 and "the disk is full (needs " in lines[0] and "100 bytes free" in lines[0]
