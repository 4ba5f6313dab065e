"""The task protocol: how a batch reaches the model, what the loss is, what evaluation reports.

The loop never looks inside a batch; it asks the task (``--task``, :func:`build_task`):

    loss = task.training_loss(model, batch)        # Loss(value, items)
    stats = task.eval_stats(task.forward(model, batch), batch)   # per-sample (loss sum, items, correct)

Batches. An ``(input, target)`` tuple (the built-in datasets) is passed as ``model(input)``; a
dict of tensors (Hugging Face style) as ``model(**batch)``, keeping only the keys ``forward``
names (the others are dropped, with a one-time warning naming them).

Loss. By default: cross-entropy of the logits for tuple batches; the model's own ``outputs.loss``
(or ``outputs["loss"]``) for dict batches of ``classification`` and ``sequence_classification``;
for ``causal_lm``, the next-token cross-entropy summed over the tokens whose ``labels`` are not
``-100``, with their count. A user ``loss_fn(outputs, batch)`` (``train(..., loss_fn=)``,
``--loss pkg.module:function``) returns a scalar mean or a ``(sum, num_items)`` pair.

Token-exact averaging. A ``(sum, num_items)`` loss gives each optimizer step the gradient of
``total loss / total items`` over its whole global batch (every accumulation micro-step, every
rank), not a mean of per-micro-batch means: see :class:`accel_ddp.update.LossAccumulator`.

Evaluation. Each eval batch gives per-sample statistics (loss sum, items, correct), gathered
so that each sample (or token) counts exactly once at any world size: ``eval_loss`` is
item-weighted; ``classification`` adds ``eval_accuracy``, ``causal_lm`` ``eval_perplexity``
and next-token ``eval_accuracy``. User metric objects (``train(..., metrics=[...])``) get
``update(outputs, batch)`` with every rank's outputs and batch gathered, then ``compute() -> dict``.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel

from accel_ddp.registry import describe
from accel_ddp.update import empty_sum
from accel_ddp.validation import ConfigError

IGNORE_INDEX = -100  # labels that count for nothing: padding, prompts (PyTorch's and Transformers' convention)
EVAL_FIELDS = ("loss_sum", "items", "correct")  # the per-sample statistics every task reports


class Loss(NamedTuple):
    """One micro-step's loss: a mean (``items`` None), or a sum over ``items`` items (tokens, samples)."""

    value: torch.Tensor  # a scalar that requires grad
    items: torch.Tensor | None = None  # a scalar count on the same device, or None for a mean


def logits_of(outputs: Any) -> torch.Tensor | None:
    """The logits of a model's output: the output itself if a tensor, else its ``logits`` field."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):  # also Transformers' ModelOutput
        return outputs.get("logits")
    return getattr(outputs, "logits", None)


def model_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned itself (``outputs.loss`` or ``outputs["loss"]``), or None."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    return getattr(outputs, "loss", None)


def labels_of(batch: Any) -> torch.Tensor | None:
    """The targets of a batch: the second element of a tuple, or ``batch["labels"]``."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    return batch[1] if len(batch) > 1 else None


def forward_keys(model: torch.nn.Module) -> set[str] | None:
    """The keyword arguments ``model.forward`` names, or None when it takes only ``**kwargs`` (then pass all).

    Like the Hugging Face Trainer, a forward with named parameters and ``**kwargs`` gets only the
    named ones: a dataset's leftover columns (raw text, ids) must not reach the model.
    """
    params = inspect.signature(extract_model_from_parallel(model).forward).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return named or None


class Task:
    """``classification``: logits ``(B, classes)`` against integer labels.

    Subclasses change the defaults (loss, per-sample statistics, metric names); the batch protocol
    and the user hooks (``loss_fn``, ``metrics``) are the same for every task.
    """

    name = "classification"
    held_back = frozenset()  # batch keys this task uses itself instead of passing them to the model

    def __init__(self, loss_fn: Callable[[Any, Any], Any] | None = None, metrics: Sequence[Any] = (),
                 memory_format: torch.memory_format = torch.contiguous_format):
        self.loss_fn = loss_fn
        self.metrics = list(metrics)  # templates: each evaluation updates fresh copies (see evaluate.py)
        self.memory_format = memory_format  # channels-last image batches when --channels_last
        self.held_back = self.held_back if loss_fn is None else frozenset()  # a user loss may need everything
        self._keep: set[str] | None = None  # dict keys passed to the model, decided at the first dict batch
        self._kept_all = False
        self._grad_checked = False  # the first training loss is checked for a grad_fn

    # ---- how a batch reaches the model

    def forward(self, model: torch.nn.Module, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return model(**self.model_inputs(model, batch))
        inputs = batch[0]
        inputs = inputs.contiguous(memory_format=self.memory_format) if inputs.ndim == 4 else inputs
        return model(inputs)

    def model_inputs(self, model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The keys of ``batch`` that ``model.forward`` takes; the first call warns once about the others."""
        if self._keep is None and not self._kept_all:
            named = forward_keys(model)
            self._kept_all = named is None
            self._keep = None if named is None else named - self.held_back
            dropped = sorted(k for k in batch if not self._passes(k) and k not in self.held_back)
            if dropped:
                _warn_once(f"batch keys {', '.join(dropped)} are not arguments of "
                           f"{type(extract_model_from_parallel(model)).__name__}.forward; they are dropped")
        return {k: v for k, v in batch.items() if self._passes(k)}

    def _passes(self, key: str) -> bool:
        return key not in self.held_back and (self._kept_all or key in self._keep)

    # ---- the training loss

    def training_loss(self, model: torch.nn.Module, batch: Any) -> Loss:
        """Forward one micro-batch and return its loss (the loop backpropagates it)."""
        outputs = self.forward(model, batch)
        loss = self.user_loss(outputs, batch) if self.loss_fn is not None else self.default_loss(outputs, batch)
        if not self._grad_checked:  # the first micro-step: an attribute read, no sync (the probe runs without grad)
            self._grad_checked = True
            if torch.is_grad_enabled() and not loss.value.requires_grad:
                raise ConfigError(f"{self.loss_name()} returned a loss detached from the model (no grad_fn: made "
                                  "with .item(), .detach(), torch.tensor(...) or under torch.no_grad()); return the "
                                  "loss tensor computed from the outputs")
        return loss

    def loss_name(self) -> str:
        return "the model" if self.loss_fn is None else f"the loss function {describe(self.loss_fn)}"

    def user_loss(self, outputs: Any, batch: Any) -> Loss:
        result = self.loss_fn(outputs, batch)
        name = describe(self.loss_fn)
        if isinstance(result, (tuple, list)) and len(result) == 2:
            total, items = result
            _check_scalar(total, name, "a (sum, num_items) pair whose sum is")
            _check_count(items, name)
            return Loss(total.reshape(()), torch.as_tensor(items, device=total.device).detach().reshape(()))
        _check_scalar(result, name, "")
        return Loss(result.reshape(()))

    def default_loss(self, outputs: Any, batch: Any) -> Loss:
        if isinstance(batch, Mapping):
            loss = model_loss(outputs)
            if loss is None:
                raise ConfigError(
                    f"{type(outputs).__name__} from the model holds no loss for a dict batch (does the batch "
                    "hold 'labels'?); give a loss with --loss pkg.module:function or train(..., loss_fn=)")
            return Loss(loss)
        return Loss(F.cross_entropy(logits_of(outputs).float(), batch[1]))

    # ---- evaluation

    def eval_stats(self, outputs: Any, batch: Any) -> torch.Tensor:
        """``(B, 3)`` float64 per sample: loss sum, items, correct (here: cross-entropy, 1, hit)."""
        logits, labels = self._logits_and_labels(outputs, batch)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        hits = logits.argmax(dim=-1) == labels
        return torch.stack([losses.double(), torch.ones_like(losses, dtype=torch.float64), hits.double()], dim=1)

    def summarize(self, totals: dict[str, float], samples: int) -> dict[str, Any]:
        """The eval metrics from the summed statistics (the summary.json keys)."""
        items = max(totals["items"], 1)
        return {"eval_loss": totals["loss_sum"] / items, "eval_accuracy": totals["correct"] / items,
                "eval_samples": samples}

    def _logits_and_labels(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits, labels = logits_of(outputs), labels_of(batch)
        if logits is None:
            raise ConfigError(f"{type(outputs).__name__} from the model holds no logits to evaluate; return a "
                              "tensor or an output with .logits, or train without an eval set")
        if labels is None:
            raise ConfigError("an eval batch holds no labels (a tuple's second element or a 'labels' key); "
                              "add them to the dataset or the collate_fn")
        return logits, labels

    # ---- the check before anything is written

    @torch.no_grad()
    def check(self, model: torch.nn.Module, batch: Any, evaluates: bool) -> None:
        """Run the model once on a small batch in eval mode and check the loss (and eval statistics).

        Bad input (no loss, a non-scalar loss, no logits to evaluate) then ends the run with one
        line before it writes anything, instead of at the first step. The RNG state is restored.
        """
        with _probing(model, batch):
            outputs = self.forward(model, batch)
            if self.loss_fn is not None:
                loss = self.user_loss(outputs, batch)
                if loss.items is not None and loss.items.item() == 0 and loss.value.item() != 0:
                    raise ConfigError(empty_sum(self.loss_name()))
            else:
                self.default_loss(outputs, batch)
            if evaluates:
                self.eval_stats(outputs, batch)

    @torch.no_grad()
    def check_logits(self, model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> None:
        """``(input, label)`` batches with the default cross-entropy: the model's logits must fit the labels.

        Shapes only, the same on every rank: a mismatch ends every rank with one line naming both.
        """
        with _probing(model, batch):
            outputs = self.forward(model, batch)
        logits, labels = logits_of(outputs), batch[1]
        if logits is None:
            raise ConfigError(f"the model returned {type(outputs).__name__} from forward; expected a tensor of logits "
                              f"(batch, num_classes) for labels of shape {tuple(labels.shape)}")
        soft_labels = labels.is_floating_point() and labels.shape == logits.shape  # class probabilities
        if logits.ndim != 2 or (labels.ndim != 1 and not soft_labels) or logits.shape[0] != labels.shape[0]:
            raise ConfigError(f"the model's output has shape {tuple(logits.shape)} but the labels have shape "
                              f"{tuple(labels.shape)}; the model must return logits of shape "
                              f"({labels.shape[0]}, num_classes)")


class SequenceClassificationTask(Task):
    """``sequence_classification``: text in, one label per text out (``AutoModelForSequenceClassification``)."""

    name = "sequence_classification"


class CausalLMTask(Task):
    """``causal_lm``: predict each next token. Logits ``(B, T, vocab)``; ``labels`` ``(B, T)`` with ``-100`` ignored.

    The labels are shifted here (position ``t`` predicts token ``t + 1``), as Transformers'
    ``*ForCausalLM`` models do. Without a ``labels`` key the labels are ``input_ids`` with padding
    (``attention_mask`` 0) ignored. The task computes the loss from the logits itself, so it keeps
    ``labels`` away from the model (which would compute a second, per-micro-batch mean loss).
    """

    name = "causal_lm"
    held_back = frozenset({"labels"})

    def default_loss(self, outputs: Any, batch: Any) -> Loss:
        logits, labels = self._shifted(outputs, batch)
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                                ignore_index=IGNORE_INDEX)
        return Loss(total, (labels != IGNORE_INDEX).sum())

    def eval_stats(self, outputs: Any, batch: Any) -> torch.Tensor:
        """Per sequence: summed next-token loss, tokens counted, tokens predicted right."""
        logits, labels = self._shifted(outputs, batch)
        losses = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none", ignore_index=IGNORE_INDEX)
        valid = labels != IGNORE_INDEX
        hits = (logits.argmax(dim=-1) == labels) & valid
        return torch.stack([losses.double().sum(1), valid.double().sum(1), hits.double().sum(1)], dim=1)

    def summarize(self, totals: dict[str, float], samples: int) -> dict[str, Any]:
        loss = totals["loss_sum"] / max(totals["items"], 1)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),  # exp overflows past ~709
                "eval_accuracy": totals["correct"] / max(totals["items"], 1), "eval_samples": samples,
                "eval_tokens": int(totals["items"])}

    def _shifted(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits_of(outputs)
        if logits is None:
            raise ConfigError(f"{type(outputs).__name__} from the model holds no logits for --task causal_lm; "
                              "return (B, T, vocab) logits, or give your own --loss")
        labels = labels_of(batch)
        if labels is None and isinstance(batch, Mapping) and "input_ids" in batch:
            labels = batch["input_ids"]
            if "attention_mask" in batch:
                labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        if labels is None:
            raise ConfigError("a causal_lm batch needs 'input_ids' (or 'labels'); tokenize the text column "
                              "(--text_column) or return them from the dataset")
        return logits[:, :-1], labels[:, 1:]


TASKS: dict[str, type[Task]] = {
    "classification": Task,
    "sequence_classification": SequenceClassificationTask,
    "causal_lm": CausalLMTask,
}


def build_task(name: str, loss_fn: Callable[[Any, Any], Any] | None = None, metrics: Sequence[Any] = (),
               memory_format: torch.memory_format = torch.contiguous_format) -> Task:
    """The task for ``--task name``, with an optional user loss and metric objects.

        >>> build_task("causal_lm").name
        'causal_lm'
    """
    if name not in TASKS:
        raise ConfigError(f"--task {name!r} is unknown; choose one of {', '.join(TASKS)}")
    for metric in metrics:
        if not (callable(getattr(metric, "update", None)) and callable(getattr(metric, "compute", None))):
            raise ConfigError(f"metric {metric!r} needs update(outputs, batch) and compute() -> dict methods")
    return TASKS[name](loss_fn, metrics, memory_format)


@contextmanager
def _probing(model: torch.nn.Module, batch: Any) -> Iterator[None]:
    """A set-up probe's forward: the model in eval mode, torch's RNG state (CPU, and the batch's GPU) restored."""
    was_training = model.training
    model.eval()
    devices = [batch_device(batch)] if batch_device(batch).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        model.train(was_training)


def batch_device(batch: Any) -> torch.device:
    values = batch.values() if isinstance(batch, Mapping) else batch
    return next(v.device for v in values if isinstance(v, torch.Tensor))


def _check_scalar(value: Any, name: str, what: str) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ConfigError(f"the loss function {name} returned {what} {_shown(value)}, not a scalar; return a mean "
                          "(e.g. losses.mean()) or a (losses.sum(), num_items) pair".replace("  ", " "))


def _check_count(items: Any, name: str) -> None:
    """``num_items`` of a ``(sum, num_items)`` loss: a number or a one-element tensor, not a flag or a list."""
    number = isinstance(items, (int, float)) and not isinstance(items, bool)
    if not (number or isinstance(items, torch.Tensor) and items.numel() == 1 and items.dtype != torch.bool):
        raise ConfigError(f"the loss function {name} returned a (sum, num_items) pair whose num_items is "
                          f"{_shown(items)}, not a count; return the number of items the sum adds up, e.g. "
                          "(losses.sum(), mask.sum())")


def _shown(value: Any) -> str:
    """A returned value as an error line shows it: a tensor's shape (and dtype), else its type and value."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}" + (" (bool)" if value.dtype == torch.bool else "")
    return f"{type(value).__name__} {value!r}"[:80] if isinstance(value, (str, int, float)) else type(value).__name__


def _warn_once(message: str) -> None:
    """A warning from the first rank only (every rank sees the same batches); callers make it once."""
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"accel_ddp: warning: {message}", file=sys.stderr, flush=True)
