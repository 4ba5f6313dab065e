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
rank), not a mean of per-micro-batch means: see :class:`accel_ddp.step.losses.LossAccumulator`.

Evaluation. Each eval batch gives per-sample statistics (loss sum, items, correct), gathered
so that each sample (or token) counts exactly once at any world size: ``eval_loss`` is
item-weighted; ``classification`` adds ``eval_accuracy``, ``causal_lm`` ``eval_perplexity``
and next-token ``eval_accuracy``. With a user loss, ``eval_loss`` is that loss (see
:func:`accel_ddp.evaluation.evaluate`), and the task's figures are reported where the outputs fit
them (:meth:`Task.eval_fits`). User metric objects (``train(..., metrics=[...])``) get
``update(outputs, batch)`` with every rank's outputs and batch gathered, then ``compute() -> dict``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel

from accel_ddp.tasks.batches import (
    batch_device,
    check_logit_shapes,
    forward_keys,
    labels_of,
    model_loss,
    per_item,
    without_kv_cache,
)
from accel_ddp.tasks.chunked_loss import linear_cross_entropy
from accel_ddp.tasks.user_code import check_count, check_scalar, fresh_copies, metric_values
from accel_ddp.util.converters import ModelBuild, ModelConverter, NoOptions
from accel_ddp.util.messages import empty_sum, warn
from accel_ddp.util.model_outputs import logits_of
from accel_ddp.util.registry import describe
from accel_ddp.util.validation import ConfigError

IGNORE_INDEX = -100  # labels that count for nothing: padding, prompts (PyTorch's and Transformers' convention)
EVAL_FIELDS = ("loss_sum", "items", "correct")  # the per-sample statistics every task reports


class Loss(NamedTuple):
    """One micro-step's loss: a mean (``items`` None), or a sum over ``items`` items (tokens, samples)."""

    value: torch.Tensor  # a scalar that requires grad
    items: torch.Tensor | None = None  # a scalar count on the same device, or None for a mean


class Task:
    """``classification``: logits ``(B, classes)`` against integer labels.

    Subclasses change the defaults (loss, per-sample statistics, metric names); the batch protocol
    and the user hooks (``loss_fn``, ``metrics``) are the same for every task.
    """

    name = "classification"
    held_back = frozenset()  # batch keys this task uses itself instead of passing them to the model
    counts_tokens = False  # are its loss's items tokens (its labels ids in a vocabulary)? The figures count them

    def __init__(self, loss_fn: Callable[[Any, Any], Any] | None = None, metrics: Sequence[Any] = (),
                 memory_format: torch.memory_format = torch.contiguous_format):
        self.loss_fn = loss_fn
        self.metrics = list(metrics)  # templates: each evaluation updates fresh copies (see evaluation.py)
        self.memory_format = memory_format  # channels-last image batches when --channels_last
        self.held_back = self.held_back if loss_fn is None else frozenset()  # a user loss may need everything
        self._keep: set[str] | None = None  # dict keys passed to the model, decided at the first dict batch
        self._kept_all = False
        self._no_cache: dict[str, Any] = {}  # {"use_cache": False} for a model that takes it (batches.without_kv_cache)
        self._grad_checked = False  # the first training loss is checked for a grad_fn
        self._fits: bool | None = None  # whether the task's eval statistics fit the outputs (eval_fits)

    # ---- how a batch reaches the model

    def forward(self, model: torch.nn.Module, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return model(**self.model_inputs(model, batch))
        inputs = batch[0]
        inputs = inputs.contiguous(memory_format=self.memory_format) if inputs.ndim == 4 else inputs
        return model(inputs)

    def model_inputs(self, model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The keys of ``batch`` that ``model.forward`` takes, and ``use_cache=False`` where it takes that (no key/value
        cache in training or evaluation: one compiled graph per block); the first call warns once about the others."""
        if self._keep is None and not self._kept_all:
            named = forward_keys(model)
            self._no_cache = without_kv_cache(model)
            self._kept_all = named is None
            self._keep = None if named is None else named - self.held_back
            dropped = sorted(k for k in batch if not self._passes(k) and k not in self.held_back)
            if dropped:
                warn(f"batch keys {', '.join(dropped)} are not arguments of "
                     f"{type(extract_model_from_parallel(model)).__name__}.forward; they are dropped", ranks="main")
        return {**self._no_cache, **{k: v for k, v in batch.items() if self._passes(k)}}

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
            check_scalar(total, name, "a (sum, num_items) pair whose sum is")
            check_count(items, name)
            return Loss(total.reshape(()), torch.as_tensor(items, device=total.device).detach().reshape(()))
        check_scalar(result, name, "")
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

    metric_names = ("eval_accuracy",)  # what the task's statistics add to eval_loss and eval_samples

    def stats_problem(self, outputs: Any, batch: Any) -> str | None:
        """Why this task's per-sample statistics cannot come from these outputs and batch; None when they can."""
        logits, labels = logits_of(outputs), labels_of(batch)
        if logits is None:
            return f"{type(outputs).__name__} from the model holds no logits"
        if not isinstance(labels, torch.Tensor):
            return "the batch holds no labels (a tuple's second element or a 'labels' key)"
        soft = labels.is_floating_point() and labels.shape == logits.shape  # class probabilities
        ids = not labels.is_floating_point() and labels.ndim == 1
        if logits.ndim != 2 or not (soft or ids) or len(logits) != len(labels):
            return (f"the model's logits of shape {tuple(logits.shape)} do not fit labels of shape "
                    f"{tuple(labels.shape)} ({self.name} takes (batch, classes) logits and (batch,) class ids)")
        return None

    def eval_fits(self, outputs: Any, batch: Any) -> bool:
        """Whether this task's statistics (``eval_accuracy``, ...) come from these outputs; decided at the first batch.

        Without a loss of the user's they must (there would be no ``eval_loss``): bad input otherwise.
        With one, ``eval_loss`` is that loss, and statistics that do not fit are left out, with one note.
        """
        if self._fits is None:
            problem = self.stats_problem(outputs, batch)
            if problem is not None and self.loss_fn is None:
                raise ConfigError(f"{problem}, so the {self.name} task has no eval_loss; give a loss of your own "
                                  "(--loss or loss_fn=; eval_loss is then that loss), the --task of these outputs, "
                                  "or no eval set")
            if problem is not None:
                self.leave_out_stats(problem)
            self._fits = problem is None
        return self._fits

    def leave_out_stats(self, reason: str) -> None:
        """With a user loss: this task's figures do not fit this model or data; say so once and leave them out."""
        warn(f"{reason}: {', '.join(self.metric_names)} left out of the evaluation; eval_loss is "
             f"{describe(self.loss_fn)}", kind="note", ranks="main")  # every rank sees the same batches
        self._fits = False

    @property
    def stats_left_out(self) -> bool:
        """True once :meth:`eval_fits` found that this task's statistics do not fit the model's outputs."""
        return self._fits is False

    def eval_stats(self, outputs: Any, batch: Any) -> torch.Tensor:
        """``(B, 3)`` float64 per sample: loss sum, items, correct (here: cross-entropy, 1, hit)."""
        logits, labels = logits_of(outputs), labels_of(batch)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        targets = labels.argmax(dim=-1) if labels.is_floating_point() else labels  # probabilities: the likeliest
        hits = logits.argmax(dim=-1) == targets
        return torch.stack([losses.double(), torch.ones_like(losses, dtype=torch.float64), hits.double()], dim=1)

    def eval_loss_sums(self, outputs: Any, batch: Any, samples: int) -> torch.Tensor:
        """``(2,)`` float64: the user's loss over a batch of ``samples`` samples as (sum, items); a mean counts as
        ``mean x samples`` over ``samples`` items."""
        loss = self.user_loss(outputs, batch)
        value = loss.value.detach().double()
        if loss.items is None:
            return torch.stack([value * samples, value.new_tensor(float(samples))])
        return torch.stack([value, loss.items.double()])

    def summarize(self, totals: dict[str, float], samples: int) -> dict[str, Any]:
        """The eval metrics from the summed statistics (the summary.json keys); None where no item was counted."""
        return {"eval_loss": per_item(totals["loss_sum"], totals["items"]),
                "eval_accuracy": per_item(totals["correct"], totals["items"]), "eval_samples": samples}

    # ---- predictions (``accel_ddp predict``)

    def predictions(self, outputs: Any, batch: Any) -> dict[str, torch.Tensor]:
        """Per sample: ``predictions``, the likeliest class id, and ``labels``, the target class id (where the batch
        has labels; for class probabilities, the likeliest), as ``eval_accuracy`` compares them."""
        logits, labels = logits_of(outputs), labels_of(batch)
        if logits is None or logits.ndim != 2:
            shape = "no logits" if logits is None else f"logits of shape {tuple(logits.shape)}"
            raise ConfigError(f"{type(outputs).__name__} from the model holds {shape}; predict needs (batch, classes) "
                              f"logits for --task {self.name}")
        out = {"predictions": logits.argmax(dim=-1)}
        if isinstance(labels, torch.Tensor) and len(labels) == len(logits):
            out["labels"] = labels.argmax(dim=-1) if labels.is_floating_point() else labels
        return out

    # ---- user metrics

    def fresh_metrics(self) -> list[Any]:
        """Copies of the metric objects for one evaluation (``copy.deepcopy``); one that cannot be copied is named."""
        return fresh_copies(self.metrics)

    # ---- the check before anything is written

    @torch.no_grad()
    def check(self, model: torch.nn.Module, batch: Any, evaluates: bool, shapes_only: bool = False) -> Any:
        """Run the model once on a small batch in eval mode and check the loss, eval statistics and metrics.

        Bad input (no loss, a non-scalar loss or count, no logits to evaluate, a metric that returns no
        numbers) then ends the run with one line before it writes anything, instead of at the first step
        or evaluation. ``shapes_only``: ``(input, label)`` batches with the default cross-entropy only
        need the logits to fit the labels. The RNG state is restored. Returns the model's outputs.
        """
        with _probing(model, batch):
            outputs = self.forward(model, batch)
            if shapes_only:
                check_logit_shapes(outputs, batch[1])
            elif self.loss_fn is not None:
                loss = self.user_loss(outputs, batch)
                if loss.items is not None and loss.items.item() == 0 and loss.value.item() != 0:
                    raise ConfigError(empty_sum(self.loss_name()))
            else:
                self.default_loss(outputs, batch)
            if evaluates:
                self.eval_fits(outputs, batch)  # shapes: its labels' range is checked next (accel_ddp.tasks.labels)
                for metric in self.fresh_metrics():  # on this rank's probe batch: what compute() returns
                    metric.update(outputs, batch)
                    metric_values(metric)
        return outputs


class SequenceClassificationTask(Task):
    """``sequence_classification``: text in, one label per text out (``AutoModelForSequenceClassification``)."""

    name = "sequence_classification"


class CausalLMTask(Task):
    """``causal_lm``: predict each next token. Logits ``(B, T, vocab)``; ``labels`` ``(B, T)`` with ``-100`` ignored.

    The labels are shifted here (position ``t`` predicts token ``t + 1``), as Transformers'
    ``*ForCausalLM`` models do: the labels move one place left and the last position is ignored, so the
    logits are used as the model returned them (slicing off their last position instead made the loss copy
    the whole ``(B, T, vocab)`` tensor, and its backward fill and copy another: 16 ms, 4% of the tiny
    GPT-2's step on one CPU thread, benchmarks/cpu_kernels.py). Without a ``labels`` key the labels are
    ``input_ids`` with padding (``attention_mask`` 0) ignored. The task computes the loss from the logits
    itself, so it keeps ``labels`` away from the model (which would compute a second, per-micro-batch mean
    loss).
    """

    name = "causal_lm"
    held_back = frozenset({"labels"})
    counts_tokens = True
    split_head: Any = None  # --chunked_loss: the model's chunked_loss.HiddenStatesHead (training: hidden states out)
    compute_dtype: torch.dtype | None = None  # --chunked_loss: the matmuls' dtype (the run's autocast dtype)

    def default_loss(self, outputs: Any, batch: Any) -> Loss:
        logits, labels = self._shifted(outputs, batch)
        if self.split_head is not None and self.split_head.training:  # "logits" are the last hidden states
            head = self.split_head
            total = linear_cross_entropy(logits, head.weight, head.bias, labels, self.compute_dtype)
            return Loss(total, (labels != IGNORE_INDEX).sum())
        # F.cross_entropy's own two kernels (torch's cross_entropy is log_softmax, then nll_loss), called directly
        # because the second also counts the labels that are not ignored (its total_weight): the items, with no
        # kernel of their own (2 host operations fewer per micro-step, benchmarks/ops_per_step.py). 2: sum.
        log_probs = F.log_softmax(logits.flatten(0, 1).float(), dim=-1)  # flatten of contiguous logits: a view
        total, items = torch.ops.aten.nll_loss_forward(log_probs, labels.flatten(), None, 2, IGNORE_INDEX)
        return Loss(total, items)

    metric_names = ("eval_perplexity", "eval_accuracy", "eval_tokens")

    def stats_problem(self, outputs: Any, batch: Any) -> str | None:
        logits, labels = logits_of(outputs), self._token_labels(batch)
        if logits is None:
            return f"{type(outputs).__name__} from the model holds no logits"
        if labels is None:
            return "the batch holds no 'input_ids' or 'labels'"
        if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(labels.shape):
            return (f"the model's logits of shape {tuple(logits.shape)} do not fit token labels of shape "
                    f"{tuple(labels.shape)} (causal_lm takes (batch, length, vocabulary) logits)")
        return None

    def eval_stats(self, outputs: Any, batch: Any) -> torch.Tensor:
        """Per sequence: summed next-token loss, tokens counted, tokens predicted right."""
        logits, labels = self._shifted(outputs, batch)
        losses = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none", ignore_index=IGNORE_INDEX)
        valid = labels != IGNORE_INDEX
        hits = (logits.argmax(dim=-1) == labels) & valid
        return torch.stack([losses.double().sum(1), valid.double().sum(1), hits.double().sum(1)], dim=1)

    def summarize(self, totals: dict[str, float], samples: int) -> dict[str, Any]:
        loss = per_item(totals["loss_sum"], totals["items"])  # None: no token to predict in the whole eval set
        return {"eval_loss": loss, "eval_perplexity": None if loss is None else math.exp(min(loss, 700.0)),
                "eval_accuracy": per_item(totals["correct"], totals["items"]), "eval_samples": samples,
                "eval_tokens": int(totals["items"])}  # exp overflows past ~709

    def predictions(self, outputs: Any, batch: Any) -> dict[str, torch.Tensor]:
        """Per sequence and position: ``predictions``, the likeliest next token, and ``labels``, the next token
        (``-100`` where nothing is predicted: padding, the last position), as ``eval_accuracy`` compares them."""
        logits, labels = self._shifted(outputs, batch)
        return {"predictions": logits.argmax(dim=-1).masked_fill(labels == IGNORE_INDEX, IGNORE_INDEX),
                "labels": labels}

    def _token_labels(self, batch: Any) -> torch.Tensor | None:
        """``labels``, else ``input_ids`` with padding (``attention_mask`` 0) ignored; unshifted."""
        labels = labels_of(batch)
        if labels is None and isinstance(batch, Mapping) and "input_ids" in batch:
            labels = batch["input_ids"]
            if "attention_mask" in batch:
                labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return labels

    def _shifted(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits_of(outputs)
        if logits is None:
            raise ConfigError(f"{type(outputs).__name__} from the model holds no logits for --task causal_lm; "
                              "return (B, T, vocab) logits, or give your own --loss")
        labels = self._token_labels(batch)
        if labels is None:
            raise ConfigError("a causal_lm batch needs 'input_ids' (or 'labels'); tokenize the text column "
                              "(--text_column) or return them from the dataset")
        return logits, F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


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



def _channels_last(model: torch.nn.Module, options: NoOptions, build: ModelBuild) -> tuple[torch.nn.Module, None]:
    return model.to(memory_format=build.task.memory_format), None  # NHWC convolutions: faster on tensor cores


# --channels_last: the model in the layout its task gives the batches (in assemble.MODEL_CONVERTERS). Always
# applied, reading no option (the task holds the flag's layout): without the flag a caller's channels-last model is
# made contiguous, as the batches are.
CHANNELS_LAST = ModelConverter("channels_last", NoOptions, applies=lambda o: True, apply=_channels_last)


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
