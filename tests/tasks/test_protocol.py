"""The task protocol (accel_ddp/tasks/protocol.py): dict batches, Transformers models, user losses and metrics,
token-exact accumulation, exact eval counts, text data, resume and outputs of Transformers runs.

Multi-process tests run on forked gloo ranks (tests/helpers/multiproc.py). transformers is imported here, in the
test process, so that the forked ranks start with it loaded.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from accel_ddp import TrainConfig, train  # noqa: E402
from accel_ddp.data.text import PadCollate  # noqa: E402
from accel_ddp.tasks.protocol import IGNORE_INDEX  # noqa: E402
from tests.helpers.multiproc import run_ranks  # noqa: E402
from tests.helpers.runs import load_weights  # noqa: E402
from tests.helpers.text import VOCAB, Sequences, build_word_tokenizer, lm_args, sentences, tiny_gpt  # noqa: E402


def token_mean(outputs, batch):
    """A per-micro-batch token mean: what a mean-of-means implementation averages."""
    logits, labels = outputs.logits[:, :-1], batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0,
                                                                                   IGNORE_INDEX)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def _lm_run(out: Path, world: int, per_device: int, loss_fn=None, steps: int = 8, **cfg) -> dict:
    def fn():
        torch.manual_seed(0)
        model = tiny_gpt()
        config = TrainConfig(task="causal_lm", global_batch_size=8, per_device_batch_size=per_device, max_steps=steps,
                             optimizer="sgd", lr=0.2, lr_schedule="constant", max_grad_norm=0, log_every=4,
                             output_dir=str(out), **cfg)
        return train(config, model=model, train_dataset=Sequences(96), loss_fn=loss_fn)

    return run_ranks(fn, world_size=world)[0]


def _max_difference(a: Path, b: Path) -> float:
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def test_token_exact_accumulation_gives_one_gradient_whatever_the_layout(tmp_path):
    """2 ranks x 4, 1 process x 8 and 1 process x 2 with 4 accumulation micro-steps end with the same weights after
    8 SGD steps on sequences of 3 to 16 tokens when each step's gradient is grad(total loss / total tokens) (the
    default causal-LM loss, a (sum, num_items) pair); a mean of per-micro-batch token means does not."""
    reference = tmp_path / "1x8"  # one micro-batch per step: both rules give the same gradient here
    _lm_run(reference, 1, 8)
    differences = {}
    for loss, loss_fn in (("token_exact", None), ("mean_of_means", token_mean)):
        for name, world, per_device in (("2x4", 2, 4), ("1x2", 1, 2)):
            summary = _lm_run(tmp_path / f"{loss}-{name}", world, per_device, loss_fn)
            assert summary["grad_accum_steps"] == 8 // (world * per_device) and summary["optimizer_steps"] == 8
            differences[loss, name] = _max_difference(tmp_path / f"{loss}-{name}", reference)
    print(f"largest weight difference against 1 process x 8: {differences}")
    assert all(differences["token_exact", name] < 1e-6 for name in ("2x4", "1x2")), differences
    assert all(differences["mean_of_means", name] > 1e-4 for name in ("2x4", "1x2")), differences
    torch.manual_seed(0)
    initial, trained = tiny_gpt().state_dict(), load_weights(reference)
    key = "transformer.h.0.mlp.c_fc.weight"  # sanity: training moved the weights far beyond the tolerance
    assert (trained[key] - initial[key]).abs().max() > 1e-2


def _graph_nodes(root) -> list[str]:
    """The names of the autograd nodes reachable from ``root`` (a ``grad_fn``)."""
    names, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(child for child, _ in node.next_functions)
    return names


def test_the_causal_lm_loss_reads_the_models_logits_as_they_are():
    """The labels move one place left, not the logits: the loss reaches the (B, T, vocab) logits through a view
    only (slicing off their last position copied the whole tensor forward, and filled and copied another in the
    backward); the value is still the next-token loss over the T - 1 predicted positions of each row."""
    from types import SimpleNamespace

    from accel_ddp.tasks.protocol import build_task

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5), generator=generator)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    loss = build_task("causal_lm").default_loss(SimpleNamespace(logits=logits), {"input_ids": ids,
                                                                                 "attention_mask": mask})
    nodes = _graph_nodes(loss.value.grad_fn)
    assert "AccumulateGrad" in nodes and not [n for n in nodes if n.startswith(("Slice", "Clone", "Copy", "Unsafe"))]
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(loss.value, expected)
    assert int(loss.items) == 4 + 2  # row 0 predicts 4 tokens, row 1 its 2 real ones after the first


# ----------------------------------------------------------------------------- evaluation counts each item once


class SeenCounter:
    """A user metric: sequences and real tokens it was shown, and the next-token accuracy from the gathered logits."""

    def __init__(self):
        self.sequences = self.tokens = self.hits = self.predicted = 0

    def update(self, outputs, batch):
        self.sequences += len(batch["input_ids"])
        self.tokens += int(batch["attention_mask"].sum())
        mask = batch["attention_mask"][:, 1:] == 1
        predictions = outputs.logits[:, :-1].argmax(-1)
        self.hits += int(((predictions == batch["input_ids"][:, 1:]) & mask).sum())
        self.predicted += int(mask.sum())

    def compute(self):
        return {"sequences": self.sequences, "eval_real_tokens": self.tokens, "my_accuracy": self.hits / self.predicted}


def _evaluate_lm(world: int, count: int = 23, batch_size: int = 4) -> list[dict]:
    def fn():
        from accel_ddp.assemble import build_world
        from accel_ddp.data.loaders import build_eval_loader
        from accel_ddp.evaluation import evaluate
        from accel_ddp.tasks.protocol import build_task

        accelerator, _, _ = build_world(TrainConfig(global_batch_size=2))
        torch.manual_seed(0)
        model = accelerator.prepare(tiny_gpt())
        loader = accelerator.prepare(build_eval_loader(Sequences(count, seed=1), batch_size, 0, PadCollate(0)))
        return evaluate(accelerator, model, loader, build_task("causal_lm", metrics=[SeenCounter()]))

    return run_ranks(fn, world_size=world)


def test_eval_of_an_odd_set_of_variable_length_sequences_is_exact_at_any_world_size():
    one, (rank0, rank1) = _evaluate_lm(1)[0], _evaluate_lm(2)
    assert rank0 == rank1 == one  # every figure, bit for bit
    lengths = [len(row) for row in Sequences(23, seed=1).rows]
    assert one["eval_samples"] == one["eval_sequences"] == 23
    assert one["eval_real_tokens"] == sum(lengths)  # the padding of the gathered batches is not counted
    assert one["eval_tokens"] == sum(n - 1 for n in lengths)  # each sequence predicts all but its first token
    assert one["eval_my_accuracy"] == one["eval_accuracy"]  # the user metric saw the same gathered logits
    assert one["eval_perplexity"] == pytest.approx(math.exp(one["eval_loss"]))
    # The reference: each sequence on its own, no padding, no batching.
    torch.manual_seed(0)
    model = tiny_gpt().eval()
    with torch.no_grad():
        total = sum(torch.nn.functional.cross_entropy(model(row[None]).logits[0, :-1], row[1:], reduction="sum")
                    for row in Sequences(23, seed=1).rows)
    assert one["eval_loss"] == pytest.approx(total.item() / one["eval_tokens"], rel=1e-6)


# ----------------------------------------------------------------------------- text from files, from the CLI


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """texts/{train,test}.json (text), reviews/{train,test}.csv (text, label), tokenizer/, gpt2.json."""
    import csv

    root = tmp_path_factory.mktemp("corpus")
    train, test = sentences(400, seed=0), sentences(101, seed=1)  # an odd eval set
    for folder, suffix in (("texts", "json"), ("reviews", "csv")):
        (root / folder).mkdir()
        for split, rows in (("train", train), ("test", test)):
            path = root / folder / f"{split}.{suffix}"
            if suffix == "json":
                path.write_text("".join(json.dumps({"text": text, "id": i}) + "\n" for i, (text, _) in enumerate(rows)))
            else:
                with open(path, "w", newline="") as fh:
                    csv.writer(fh).writerows([("review", "sentiment"), *rows])
    build_word_tokenizer([text for text, _ in train], root / "tokenizer")
    (root / "gpt2.json").write_text(json.dumps({
        "model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 8,
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}))
    return root


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch) -> Path:
    """A fresh datasets cache for this test (forked ranks inherit it)."""
    import datasets

    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


def test_causal_lm_from_a_config_on_text_files(corpus, datasets_cache, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.runs import read_metrics, train_ranks

    out = tmp_path / "lm"
    summary = train_ranks(lm_args(corpus, out, "--packing", "--epochs", "3", "--lr", "1e-2"), world_size=2)[0]
    evals = [r for r in read_metrics(out) if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.3, evals
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
    assert summary["eval_perplexity"] < 10  # from ~25 (the vocabulary) at the start
    assert summary["eval_tokens"] == summary["eval_samples"] * 31  # packed blocks of 32: 31 predictions each
    # The final model as a Transformers folder, with its tokenizer, equal to model.safetensors.
    model = AutoModelForCausalLM.from_pretrained(out / "hf_model")
    weights = load_weights(out)
    assert all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())
    assert AutoTokenizer.from_pretrained(out / "hf_model")("the food was good")["input_ids"][-1] > 2
    card = (out / "README.md").read_text()  # the model card names the config, the perplexity and hf_model/
    assert "gpt2.json` (fresh weights, --task causal_lm)" in card and "| eval perplexity |" in card
    assert "[`hf_model/`](hf_model)" in card and "- perplexity" in card
    startup = yaml.safe_load((out / "config.yaml").read_text())["startup"]  # a token task: the tokens of a step
    assert startup["tokens per step"] == "512 = 16 sequences x 32", startup
    # Tokenized once per machine: the second rank read the first rank's cache, so one file per split.
    caches = sorted(datasets_cache.rglob("cache-*.arrow"))
    assert len(caches) == 2, caches
    train_ranks(lm_args(corpus, tmp_path / "again", "--packing", "--max_steps", "1"), world_size=2)
    assert sorted(datasets_cache.rglob("cache-*.arrow")) == caches  # a later run too
    # That later run read the packed blocks from --text_cache and loaded no tokenizer in its data phase (the
    # manifest's length and special ids stand in): it trains the same weights as a run that tokenizes, and saves
    # the same tokenizer beside them.
    train_ranks(lm_args(corpus, tmp_path / "off", "--packing", "--max_steps", "1", "--text_cache", "off"),
                world_size=2)
    hit, off = load_weights(tmp_path / "again"), load_weights(tmp_path / "off")
    assert hit.keys() == off.keys() and all(torch.equal(hit[name], off[name]) for name in hit)
    saved = [(tmp_path / run / "hf_model" / "tokenizer.json").read_bytes() for run in ("again", "off")]
    assert saved[0] == saved[1] == (corpus / "tokenizer" / "tokenizer.json").read_bytes()


def test_sequence_classification_on_a_csv_of_labelled_texts(corpus, datasets_cache, tmp_path):
    from tests.helpers.runs import train_ranks

    args = ["--task", "sequence_classification", "--dataset", "hf", "--data_dir", str(corpus / "reviews"),
            "--text_column", "review", "--label_column", "sentiment", "--tokenizer", str(corpus / "tokenizer"),
            "--model_config", str(corpus / "gpt2.json"), "--max_length", "32", "--global_batch_size", "16",
            "--epochs", "1", "--lr", "3e-3", "--output_dir", str(tmp_path / "cls")]
    rank0, rank1 = train_ranks(args, world_size=2)
    assert rank0["eval_samples"] == 101 and rank0["eval_accuracy"] == rank1["eval_accuracy"]
    assert rank0["eval_accuracy"] > 0.95, rank0
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls" / "hf_model")
    assert model.config.num_labels == 2 and model.config.pad_token_id == 0
    said = yaml.safe_load((tmp_path / "cls" / "config.yaml").read_text())
    assert said["startup"]["model"].startswith(  # the flag that named the model, and the kernels swapped in it
        f"GPT2ForSequenceClassification (--model_config {corpus / 'gpt2.json'}), "), said["startup"]["model"]
    assert said["startup"]["model"].endswith(" tanh-GELU modules on torch's one kernel (--fused_kernels)")
    assert "tokens per step" not in said["startup"]  # texts, but one label each: not a token task


def test_crash_mid_epoch_then_resume_is_bitwise_exact_for_a_pretrained_lm_folder(corpus, datasets_cache, tmp_path):
    """A save_pretrained folder (with dropout, so the RNG state matters) fine-tuned on variable-length padded text."""
    from transformers import AutoTokenizer

    from accel_ddp.cli.args import parse_args
    from accel_ddp.loop import train as train_cli
    from tests.helpers import faults
    from tests.helpers.multiproc import RankFailed
    from tests.helpers.runs import train_ranks

    pretrained = tmp_path / "pretrained"
    tokenizer = AutoTokenizer.from_pretrained(corpus / "tokenizer")
    torch.manual_seed(0)
    tiny_gpt(vocab=len(tokenizer), dropout=0.1).save_pretrained(pretrained)
    tokenizer.save_pretrained(pretrained)  # --tokenizer defaults to the model folder's

    def args(out: Path, *extra: str) -> list[str]:
        return ["--task", "causal_lm", "--dataset", "hf", "--data_dir", str(corpus / "texts"), "--model",
                str(pretrained), "--max_length", "32", "--global_batch_size", "16", "--per_device_batch_size", "4",
                "--max_steps", "6", "--checkpointing_steps", "2", "--output_dir", str(out), *extra]

    train_ranks(args(tmp_path / "reference"), world_size=2)
    crashed = tmp_path / "crashed"

    def crash_after_step_3():
        faults.install(fail_at=(3, int(os.environ["RANK"])))  # the whole job dies after step 3 of 25 in the epoch
        train_cli(parse_args(args(crashed)))

    with pytest.raises(RankFailed, match="injected failure on rank 1 at step 3"):
        run_ranks(crash_after_step_3, world_size=2)
    assert not (crashed / "model.safetensors").exists()
    summary = train_ranks(args(crashed, "--resume_from_checkpoint", "auto"), world_size=2)[0]
    assert summary["resumed_from_step"] == 2 and summary["grad_accum_steps"] == 2
    got, expected = load_weights(crashed), load_weights(tmp_path / "reference")
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{key} differs from the uninterrupted run's"


# ----------------------------------------------------------------------------- user losses, dropped keys, bad input


def cross_entropy(outputs, batch):
    """``--loss tests.tasks.test_protocol:cross_entropy``: the default loss of tuple batches, written by a user."""
    return torch.nn.functional.cross_entropy(outputs.float(), batch[1])


def per_sample_losses(outputs, batch):
    """A common mistake: per-sample losses, not reduced to a scalar."""
    return torch.nn.functional.cross_entropy(outputs.logits[:, -1].float(), batch["input_ids"][:, -1], reduction="none")


class LosslessModel(torch.nn.Module):
    """Takes dict batches, returns logits only: with dict batches and no loss_fn there is no loss to train on."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)

    def forward(self, input_ids, attention_mask=None):
        return {"logits": self.embed(input_ids).mean(1)}


def build_lossless(num_classes, input_shape):
    return LosslessModel()


@functools.cache
def _pad_only_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocab), pad_token="[PAD]", unk_token="[UNK]")


def hf_lm_collate(samples):
    """``--collate_fn tests.tasks.test_protocol:hf_lm_collate``: Transformers' own language-modelling collator."""
    from transformers import DataCollatorForLanguageModeling

    with open(os.environ["COLLATE_CALLS"], "a") as log:  # the test checks that this collator made the batches
        log.write(f"{len(samples)}\n")
    return DataCollatorForLanguageModeling(_pad_only_tokenizer(), mlm=False)(samples)


def test_transformers_collators_work_unchanged_from_the_cli(tmp_path):
    """DataCollatorForLanguageModeling (labels made by the collator) trains exactly like the built-in padding."""
    from tests.helpers.runs import train_ranks

    base = ["--task", "causal_lm", "--dataset", "tests.helpers.text:build_sequences", "--model",
            "tests.helpers.text:build_gpt", "--global_batch_size", "8", "--max_steps", "6", "--optimizer", "sgd"]
    train_ranks([*base, "--output_dir", str(tmp_path / "ours")], world_size=1)
    calls = tmp_path / "calls"
    train_ranks([*base, "--collate_fn", "tests.tasks.test_protocol:hf_lm_collate",
                 "--output_dir", str(tmp_path / "hf")], world_size=1, env={"COLLATE_CALLS": str(calls)})
    assert calls.read_text().split()[:7] == ["2"] + ["8"] * 6  # the pre-training check, then one batch per step
    ours, theirs = load_weights(tmp_path / "ours"), load_weights(tmp_path / "hf")
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)


TINY_RUN = ["--dataset", "synthetic", "--synthetic_samples", "64", "--synthetic_shape", "4", "--global_batch_size",
            "16", "--epochs", "1"]
TINY = [*TINY_RUN, "--hidden_size", "8"]  # the mlp's size: refused beside another --model (config/dependents.py)


def test_a_user_loss_from_the_cli_trains_like_the_default(tmp_path):
    from tests.helpers.runs import train_ranks

    train_ranks([*TINY, "--output_dir", str(tmp_path / "default")], world_size=1)
    train_ranks([*TINY, "--loss", "tests.tasks.test_protocol:cross_entropy", "--output_dir", str(tmp_path / "user")],
                world_size=1)
    default, user = load_weights(tmp_path / "default"), load_weights(tmp_path / "user")
    assert all(torch.equal(user[key], default[key]) for key in default)


def test_dict_keys_the_forward_does_not_take_are_dropped_with_one_warning(tmp_path, capfd):
    class WithIds(Sequences):
        def __getitem__(self, index):
            return {**super().__getitem__(index), "doc_id": torch.tensor(index)}

    def fn():
        torch.manual_seed(0)
        config = TrainConfig(task="causal_lm", global_batch_size=8, max_steps=6, output_dir=str(tmp_path))
        return train(config, model=tiny_gpt(), train_dataset=WithIds(48), eval_dataset=WithIds(9))

    run_ranks(fn, world_size=2)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "doc_id" in line]
    assert warnings == ["accel_ddp: warning: batch keys doc_id are not arguments of GPT2LMHeadModel.forward; "
                        "they are dropped"]


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("accel_ddp:") or "Traceback" in line]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("accel_ddp: error: ")
    return lines[0]


@pytest.mark.parametrize("extra, message", [
    (["--task", "translation"], "--task 'translation' is unknown; choose one of classification, "
                                "sequence_classification, causal_lm"),
    (["--tokenizer", "tok"], "--tokenizer on --task classification: nothing would use it; add --task "
                             "sequence_classification or --task causal_lm"),
    (["--task", "causal_lm"], "--task causal_lm needs a Transformers model: --model FOLDER (save_pretrained) or "
                              "--model_config config.json"),
    (["--model_config", "missing.json"], "--model_config missing.json: no such file"),
    (["--task", "causal_lm", "--model", "accel_ddp"], "--model accel_ddp: a folder without a config.json; give a "
                                                      "folder written by save_pretrained"),
])
def test_bad_task_options_are_one_line_and_exit_2(tmp_path, capfd, extra, message):
    from accel_ddp.cli.train import main

    out = tmp_path / "out"
    assert main([*TINY_RUN, *extra, "--output_dir", str(out)]) == 2
    assert message in _one_error_line(capfd.readouterr().err)
    assert not out.exists() or not any(out.iterdir())


def _bad_text_runs(corpus: Path, out: Path) -> dict[str, tuple[list[str], str]]:
    lm = lm_args(corpus, out)
    return {
        "missing tokenizer folder": (
            lm_args(corpus, out, "--tokenizer", str(corpus / "no_such_tokenizer")),
            f"--tokenizer {corpus / 'no_such_tokenizer'}: no such folder; give a folder written by "
            "tokenizer.save_pretrained"),
        "missing text column": (
            [*lm, "--text_column", "body"],
            "hf: no text column 'body'; the columns are text, id; name the text with --text_column"),
        "non-scalar loss": ([*lm, "--loss", "tests.tasks.test_protocol:per_sample_losses"],
                            "the loss function tests.tasks.test_protocol:per_sample_losses returned a tensor of "
                            "shape (2,), not a scalar"),
        "no loss": (["--dataset", "tests.helpers.text:build_sequences",
                     "--model", "tests.tasks.test_protocol:build_lossless", "--global_batch_size", "8",
                     "--output_dir", str(out)],
                    "holds no loss for a dict batch (does the batch hold 'labels'?); give a loss with --loss"),
    }


@pytest.mark.parametrize("case", ["missing tokenizer folder", "missing text column", "non-scalar loss", "no loss"])
def test_bad_text_input_is_one_line_from_one_rank_exit_2_nothing_written(corpus, datasets_cache, tmp_path, capfd,
                                                                          case):
    from tests.helpers.runs import main_ranks

    out = tmp_path / "out"
    argv, message = _bad_text_runs(corpus, out)[case]
    assert main_ranks(argv, world_size=2) == [2, 2]
    line = _one_error_line(capfd.readouterr().err)
    assert message in line, line
    assert not out.exists() or not any(out.iterdir())


def test_without_transformers_text_is_one_line_with_the_install_command_and_images_still_train(
        corpus, tmp_path, capfd, monkeypatch):
    import sys

    from accel_ddp.cli.train import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    assert main(lm_args(corpus, tmp_path / "lm")) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert "needs the transformers package, which is not installed; pip install 'accel_ddp[nlp]'" in line
    assert main([*TINY, "--output_dir", str(tmp_path / "image")]) == 0


class ClassCounter:
    """A user metric on tuple batches: samples seen and accuracy recomputed from the gathered logits."""

    def __init__(self):
        self.seen, self.hits, self.indices = 0, 0, []

    def update(self, outputs, batch):
        inputs, labels = batch
        self.seen += len(labels)
        self.hits += int((outputs.argmax(-1) == labels).sum())
        self.indices += inputs[:, 0].round().long().tolist()  # each eval input carries its own index

    def compute(self):
        return {"seen": self.seen, "my_accuracy": self.hits / self.seen, "distinct": len(set(self.indices))}


@pytest.mark.parametrize("loader", ["device", "dataloader"])
def test_user_metrics_see_each_eval_sample_once_on_either_eval_loader(tmp_path, loader):
    """The in-memory eval loader shards 37 samples 18/19 without repeats; the DataLoader pads the last batch."""
    def fn():
        generator = torch.Generator().manual_seed(0)
        train_x, eval_x = torch.randn(64, 4, generator=generator), torch.randn(37, 4, generator=generator)
        eval_x[:, 0] = torch.arange(37, dtype=torch.float32)
        train_y, eval_y = [(x[:, 1] > 0).long() for x in (train_x, eval_x)]
        config = TrainConfig(model="mlp", hidden_size=8, global_batch_size=16, epochs=1, loader=loader,
                             eval_batch_size=4, output_dir=str(tmp_path / loader))
        return train(config, train_dataset=torch.utils.data.TensorDataset(train_x, train_y),
                     eval_dataset=torch.utils.data.TensorDataset(eval_x, eval_y), metrics=[ClassCounter()])

    rank0, rank1 = run_ranks(fn, world_size=2)
    assert rank0["loader"] == loader
    assert rank0["eval_seen"] == rank0["eval_distinct"] == rank0["eval_samples"] == 37
    assert rank0["eval_my_accuracy"] == rank0["eval_accuracy"] == rank1["eval_my_accuracy"]


# ----------------------------------------------------------------------------- the examples, small


def test_pydoc_examples_pretrain_an_lm_then_fine_tune_it_as_a_topic_classifier(datasets_cache, tmp_path):
    """examples/pydoc_text.py with small settings: docs/tasks.md runs the same commands at full size."""
    from examples.pydoc_text import TOPICS, write_lm, write_topics
    from tests.helpers.runs import REPO, train_ranks

    lm_data, topics_data, lm_out = tmp_path / "pydoc_lm", tmp_path / "pydoc_topics", tmp_path / "lm"
    counts = write_lm(str(lm_data), vocab_size=512)
    assert counts["train"] > 1000 and counts["test"] > 100  # CPython's reference: ~1,600 distinct paragraphs
    # The example's GPT-2 config, narrower and shallower: what the test shows (the folders the example writes, a
    # model from a config trained on them, its tokenizer carried on to the classifier) is not in the model's size.
    config = json.loads((REPO / "examples/configs/tiny_gpt2.json").read_text())
    (tmp_path / "gpt2.json").write_text(json.dumps({**config, "n_layer": 2, "n_embd": 64}))
    lm = train_ranks(["--task", "causal_lm", "--dataset", "hf", "--data_dir", str(lm_data), "--tokenizer",
                      str(lm_data / "tokenizer"), "--model_config", str(tmp_path / "gpt2.json"),
                      "--packing", "--max_length", "64", "--global_batch_size", "16", "--max_steps", "8",
                      "--lr", "1e-2", "--output_dir", str(lm_out)], world_size=2)[0]
    assert lm["eval_perplexity"] < 512 / 2, lm  # an untrained model: about the vocabulary size, 512

    topics = write_topics(str(topics_data))
    classifier = train_ranks(
        ["--task", "sequence_classification", "--dataset", "hf", "--data_dir", str(topics_data), "--label_column",
         "topic", "--model", str(lm_out / "hf_model"), "--max_length", "64", "--global_batch_size", "8",
         "--max_steps", "3", "--output_dir", str(tmp_path / "topics")], world_size=2)[0]
    assert classifier["eval_samples"] == topics["test"] and 0 <= classifier["eval_accuracy"] <= 1
    # The language model's tokenizer came with its folder and went on with the classifier.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "topics" / "hf_model")
    assert model.config.num_labels == len(TOPICS)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "topics" / "hf_model")) == 512


# ----------------------------------------------------------------------------- bad text data (issue 20)


def _texts(folder: Path, rows: int, *, eval_rows: int | None = None, bad_line: int | None = None) -> Path:
    """``folder/train.jsonl`` (and ``test.jsonl``) of labelled reviews; ``bad_line`` of train holds a Latin-1 byte."""
    folder.mkdir(parents=True)
    for split, count in (("train", rows), ("test", eval_rows)):
        if count is not None:
            lines = [json.dumps({"text": text, "label": label}).encode() + b"\n"
                     for text, label in sentences(count, 3)]
            if split == "train" and bad_line is not None:
                lines[bad_line - 1] = b'{"text": "caf\xe9 was good .", "label": "pos"}\n'
            (folder / f"{split}.jsonl").write_bytes(b"".join(lines))
    return folder


def _tokenizer_without(folder: Path, *missing: str) -> Path:
    """The corpus's word-level tokenizer without some of its special tokens ("pad", "eos")."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = {"pad": "[PAD]", "unk": "[UNK]", "eos": "[EOS]"}
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    kept = {name: token for name, token in special.items() if name not in missing}
    tokenizer.train_from_iterator([text for text, _ in sentences(200, 0)],
                                  trainers.WordLevelTrainer(special_tokens=list(kept.values())))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **{f"{name}_token": token for name, token in kept.items()}
                            ).save_pretrained(str(folder))
    return folder


def _classify(corpus: Path, data: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return ["--task", "sequence_classification", "--dataset", "hf", "--data_dir", str(data), "--tokenizer",
            str(tokenizer), "--model_config", str(corpus / "gpt2.json"), "--max_length", "32", "--global_batch_size",
            "8", "--output_dir", str(out), *extra]


@pytest.mark.parametrize("case", ["packing too little", "not utf-8", "one row", "no pad nor eos"])
def test_bad_text_data_is_one_line_and_exit_2_on_every_rank(corpus, datasets_cache, tmp_path, capfd, case):
    from tests.helpers.runs import main_ranks

    out = tmp_path / "out"
    if case == "packing too little":  # 20 short reviews make fewer than one block of 512 tokens
        argv = lm_args(corpus, out, "--data_dir", str(_texts(tmp_path / "d", 20, eval_rows=20)), "--packing",
                       "--max_length", "512", "--model_config", str(corpus / "gpt2_long.json"))
        (corpus / "gpt2_long.json").write_text(json.dumps({**json.loads((corpus / "gpt2.json").read_text()),
                                                           "n_positions": 512}))
        message = "--packing: the texts of the train split of"
    elif case == "not utf-8":
        data = _texts(tmp_path / "d", 40, eval_rows=10, bad_line=7)
        argv = _classify(corpus, data, corpus / "tokenizer", out)
        message = f"{data / 'train.jsonl'} line 7 is not UTF-8"
    elif case == "one row":
        argv = _classify(corpus, _texts(tmp_path / "d", 1), corpus / "tokenizer", out)
        message = "has 1 row and no eval split"
    else:
        tokenizer = _tokenizer_without(tmp_path / "tok", "pad", "eos")
        argv = _classify(corpus, _texts(tmp_path / "d", 40, eval_rows=10), tokenizer, out)
        message = f"--tokenizer {tokenizer} has no pad token and no end-of-text token"
    assert main_ranks(argv, world_size=2) == [2, 2]
    line = _one_error_line(capfd.readouterr().err)
    assert message in line and "; " in line, line
    assert not out.exists()


def test_a_classifier_whose_tokenizer_has_no_pad_token_pads_with_its_eos_token(corpus, datasets_cache, tmp_path,
                                                                               capfd):
    """GPT2ForSequenceClassification finds each text's last token by the pad token: without one it raised
    'Cannot handle batch sizes > 1 if no padding token is defined' at the first batch. The usual choice
    (tokenizer.pad_token = tokenizer.eos_token) is made, said once, and saved with the final model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tests.helpers.runs import train_ranks

    tokenizer = _tokenizer_without(tmp_path / "tok", "pad")
    out = tmp_path / "out"
    summary = train_ranks(_classify(corpus, _texts(tmp_path / "d", 40, eval_rows=10), tokenizer, out,
                                    "--max_steps", "4"), world_size=2)[0]
    assert summary["optimizer_steps"] == 4 and summary["eval_samples"] == 10
    notes = [line for line in capfd.readouterr().err.splitlines() if "has no pad token" in line]
    assert notes == [f"accel_ddp: note: --tokenizer {tokenizer} has no pad token; padding with its end-of-text token "
                     "'[EOS]' (tokenizer.pad_token = tokenizer.eos_token, the usual choice for GPT-style models)"]
    saved = AutoTokenizer.from_pretrained(out / "hf_model")
    assert saved.pad_token == "[EOS]"
    assert AutoModelForSequenceClassification.from_pretrained(out / "hf_model").config.pad_token_id == \
        saved.eos_token_id


def test_the_task_says_whether_it_counts_tokens(tmp_path):
    """``Task.counts_tokens``, not the task's name: the throughput's tokens/s, the start-up block's tokens per step
    and the probe's id ranges all ask it; nothing outside config/ (which has only the flag) compares the name."""
    import ast

    import accel_ddp
    from accel_ddp.tasks.protocol import TASKS, build_task

    assert {name: build_task(name).counts_tokens for name in TASKS} == {
        "classification": False, "sequence_classification": False, "causal_lm": True}

    def name_compares(package: Path) -> list[str]:
        return [f"{path.relative_to(package)}:{node.lineno}" for path in sorted(package.rglob("*.py"))
                if path.relative_to(package).parts[0] != "config"
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.Compare) and any(isinstance(side, ast.Constant) and side.value == "causal_lm"
                                                         for side in (node.left, *node.comparators))]

    assert name_compares(Path(accel_ddp.__file__).parent) == []
    (tmp_path / "step_log.py").write_text('def tokens(run):\n    return run.task.name == "causal_lm"\n')
    assert name_compares(tmp_path) == ["step_log.py:2"]
