"""Callbacks: a user's objects whose hooks run on every rank, and the requests they make (stop, save, evaluate),
agreed by every rank right after the optimizer step they were made at.

    class StopAt12:
        def on_step_end(self, state):
            if state.step == 12 and state.is_main_process:
                state.should_stop = True        # every rank stops after step 12

    train(cfg, callbacks=[StopAt12()])          # or: --callbacks my_pkg.callbacks:StopAt12

An object may have any of the hooks, each called on every rank, callbacks in the order given:

    on_train_begin(state)                       once the run is set up, before its first step (state.step: where a
                                                resumed run starts)
    on_step_end(state)                          after each optimizer step, before its log line, evaluation and save
    on_evaluate(state, metrics)                 after each evaluation (the gathered metrics: the same on every rank)
    on_save(state, checkpoint_dir)              after each checkpoint (folder or store URL)
    on_train_end(state, summary)                after summary.json is written

``state`` (``CallbackState``) says ``step`` (optimizer steps done), ``epoch`` (0-based, as in metrics.jsonl),
``max_steps``, ``is_main_process``, ``process_index``; a callback sets ``should_stop``, ``should_save`` or
``should_evaluate``. The ranks agree on the requests (a request on any rank is every rank's) after each step's
``on_step_end`` and after each evaluation during training: ``Callbacks.step_end`` and ``evaluated`` return or
update ``asked``, which ``AfterStep`` (accel_ddp/after_step.py) honours at that step. The agreement is one
all-reduce of three int64 over the CPU gloo group the preemption flags use (no device synchronisation), made only
when callbacks are given: without them a step calls nothing new.

A hook that raises stops the run like any failure: ``UserCodeFailed``, one line naming the callback, the hook and
where it raised (exit 1; lifecycle/failure.py), the checkpoints written so far kept.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from accel_ddp.util.messages import first_line, warn
from accel_ddp.util.registry import resolve
from accel_ddp.util.validation import ConfigError, UserCodeFailed

# Each hook and what it is called with after ``state``.
HOOKS = {"on_train_begin": (), "on_step_end": (), "on_evaluate": ("metrics",), "on_save": ("checkpoint_dir",),
         "on_train_end": ("summary",)}


class CallbackState:
    """What a callback reads (``step``, ``epoch``, ``max_steps``, ``is_main_process``, ``process_index``: read-only)
    and the requests it may set (``should_stop``, ``should_save``, ``should_evaluate``), reset once agreed. Any other
    attribute is an AttributeError: a misspelt request must not pass silently."""

    __slots__ = ("_step", "_epoch", "_max_steps", "_main", "_index", "should_stop", "should_save", "should_evaluate")

    def __init__(self, max_steps: int = 0, is_main_process: bool = True, process_index: int = 0):
        self._step, self._epoch, self._max_steps = 0, 0, max_steps
        self._main, self._index = is_main_process, process_index
        self.should_stop = self.should_save = self.should_evaluate = False

    step = property(lambda self: self._step, doc="optimizer steps done")
    epoch = property(lambda self: self._epoch, doc="the step's epoch, 0-based as in metrics.jsonl (on_train_begin: "
                                                   "the epoch the run starts in)")
    max_steps = property(lambda self: self._max_steps, doc="optimizer steps the run is planned to take")
    is_main_process = property(lambda self: self._main, doc="Accelerate's main process (the one that writes files)")
    process_index = property(lambda self: self._index, doc="this rank")

    def __repr__(self) -> str:
        return (f"CallbackState(step={self.step}, epoch={self.epoch}, max_steps={self.max_steps}, "
                f"is_main_process={self.is_main_process}, should_stop={self.should_stop}, "
                f"should_save={self.should_save}, should_evaluate={self.should_evaluate})")


@dataclass
class Requests:
    """What every rank agreed to do after a step: stop (the run finishes there), save a checkpoint, evaluate."""

    stop: bool = False
    save: bool = False
    evaluate: bool = False


NOTHING = Requests()  # without callbacks: every step's answer (never changed)


class Callbacks:
    """The run's callbacks (none: every method returns at once, and no collective is made)."""

    def __init__(self, callbacks: Sequence[Any] = ()):
        self.callbacks = list(callbacks)
        self.state = CallbackState()
        self.asked = Requests()  # the last agreement's requests not yet honoured
        self.stopped_at: int | None = None  # the step a callback's should_stop ended the run after
        self.stop_reason = ""
        self._group, self._distributed, self._evaluates, self._said_no_eval = None, False, True, False
        self._steps_per_epoch, self._processes = 1, 1
        self._flags = torch.zeros(3, dtype=torch.int64)  # [who asked to stop, save, evaluate]: MAX suits all three
        self._values = self._flags.numpy()  # the same memory: read and written without a torch call
        self._stopper = 0  # who asked this rank's callbacks to stop (_stop_code), 0: none
        self._saved_step: int | None = None

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    @classmethod
    def build(cls, names: str | None, given: Sequence[Any] | None) -> Callbacks:
        """``--callbacks`` (``pkg.module:Name`` each, made with no arguments), then ``train(callbacks=)`` (objects,
        or classes made with no arguments); each checked: it has a hook, and its hooks take what they are given."""
        made = [_make(name.strip()) for name in (names or "").split(",") if name.strip()]
        made += [_instance(item) for item in given or ()]
        for callback in made:
            _check(callback)
        return cls(made)

    def connect(self, accelerator: Any, group: Any, plan: Any, evaluates: bool) -> Callbacks:
        """Once the run is planned: what ``state`` says, and the group the requests are agreed over (``group``:
        the preemption flags' CPU gloo group, None for the default one)."""
        self.state = CallbackState(plan.total_steps, accelerator.is_main_process, accelerator.process_index)
        self._processes = accelerator.num_processes
        self._distributed = self._processes > 1 and dist.is_available() and dist.is_initialized()
        self._group, self._evaluates, self._steps_per_epoch = group, evaluates, plan.steps_per_epoch
        if self.callbacks and accelerator.is_main_process:
            for callback in self.callbacks:
                _warn_unknown_hooks(callback)
        return self

    # ---- the hooks, where the run calls them

    def train_begin(self, step: int) -> None:
        if self.callbacks:
            self._at(step, min(step, max(self.state.max_steps - 1, 0)) // max(self._steps_per_epoch, 1))
            self._call("on_train_begin")

    def step_end(self, step: int, epoch: int) -> Requests:
        """After optimizer ``step``: ``on_step_end`` on every rank, then what any rank asked, agreed (collective
        with callbacks; ``NOTHING`` at once without)."""
        if not self.callbacks:
            return NOTHING
        self._at(step, epoch)
        self._call("on_step_end")
        self.asked = self._agree(step)
        return self.asked

    def evaluated(self, step: int, epoch: int, metrics: dict[str, Any], during_training: bool = True) -> None:
        """After an evaluation: ``on_evaluate``; during training, a stop or save asked there is agreed (collective)
        and joins ``asked`` (an evaluation asked there is dropped: this step was just evaluated)."""
        if not self.callbacks:
            return
        self._at(step, epoch)
        self._call("on_evaluate", dict(metrics))
        if during_training:
            agreed = self._agree(step)
            self.asked.stop, self.asked.save = self.asked.stop or agreed.stop, self.asked.save or agreed.save

    def saved(self, step: int, epoch: int, folder: str) -> None:
        """After the checkpoint of ``step`` (once per step): ``on_save``; a save asked for this step is done."""
        if not self.callbacks:
            return
        self.asked.save = False
        if step == self._saved_step:  # saved already (a preemption right after a scheduled save)
            return
        self._saved_step = step
        self._at(step, epoch)
        self._call("on_save", folder)

    def train_end(self, step: int, epoch: int, summary: dict[str, Any]) -> None:
        if self.callbacks:
            self._at(step, epoch)
            self._call("on_train_end", dict(summary))

    def summary(self) -> dict[str, Any]:
        """summary.json's keys: the callbacks' names and, where one ended the run, ``stopped_early`` (as early
        stopping's: a relaunch of the run has nothing left to do)."""
        if not self.callbacks:
            return {}
        out: dict[str, Any] = {"callbacks": [_name(callback) for callback in self.callbacks]}
        if self.stopped_at is not None:
            out["stopped_early"] = {"step": self.stopped_at, "reason": self.stop_reason}
        return out

    # ---- inside

    def _at(self, step: int, epoch: int) -> None:
        self.state._step, self.state._epoch = step, epoch

    def _call(self, hook: str, *args: Any) -> None:
        hooks, state = list(HOOKS), self.state
        for index, callback in enumerate(self.callbacks):
            method = getattr(callback, hook, None)
            if method is None:
                continue
            asked_before = state.should_stop
            try:
                method(state, *args)
            except Exception as err:  # noqa: BLE001 - the user's code: one line naming it, its traceback as the cause
                raise UserCodeFailed(f"callback {_name(callback)}.{hook} raised {type(err).__name__}: "
                                     f"{first_line(err, 200)}{_where(err)}") from err
            if state.should_stop and not asked_before and not self._stopper:
                self._stopper = self._stop_code(hooks.index(hook), index)

    def _agree(self, step: int) -> Requests:
        """Every rank's requests, agreed (an all-reduce with several ranks); the state's requests reset."""
        state = self.state
        self._values[:] = (self._stopper if state.should_stop else 0, bool(state.should_save),
                           bool(state.should_evaluate))
        if self._distributed:
            dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self._group)
        stop, save, evaluate = (int(value) for value in self._values)
        state.should_stop = state.should_save = state.should_evaluate = False
        self._stopper = 0
        if evaluate and not self._evaluates:  # said once; later requests are dropped as quietly
            if not self._said_no_eval:
                warn(f"a callback set should_evaluate at step {step}, but the run has no eval set: nothing to "
                     "evaluate", ranks="main", above_bar=True)
            self._said_no_eval, evaluate = True, 0
        if stop and self.stopped_at is None:
            self.stopped_at, self.stop_reason = step, self._who(stop)
        return Requests(stop=bool(stop), save=bool(save), evaluate=bool(evaluate))

    def _stop_code(self, hook: int, index: int) -> int:
        """Who asked to stop, as a number whose largest over the ranks is the lowest rank's first callback's (the
        all-reduce keeps the MAX): 1 + hook + hooks x (callbacks - 1 - callback + callbacks x (ranks - 1 - rank))."""
        count = len(self.callbacks)
        return 1 + hook + len(HOOKS) * (count - 1 - index + count * (self._processes - 1 - self.state.process_index))

    def _who(self, code: int) -> str:
        hooks, count = list(HOOKS), len(self.callbacks)
        hook, rest = (code - 1) % len(hooks), (code - 1) // len(hooks)
        index, rank = count - 1 - rest % count, self._processes - 1 - rest // count
        return f"callback {_name(self.callbacks[index])}.{hooks[hook]} on rank {rank} set should_stop"


def _name(callback: Any) -> str:
    return type(callback).__name__


def _where(err: BaseException) -> str:
    """`` (at file.py:12)``: the innermost frame of the traceback, where the user's code raised."""
    frames = traceback.extract_tb(err.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _make(name: str) -> Any:
    """``--callbacks pkg.module:Name``: imported and made with no arguments (a failure: one line, exit 2)."""
    if ":" not in name or not all(name.partition(":")[::2]):
        raise ConfigError(f"--callbacks {name}: give each callback as 'pkg.module:Name' (a class, or a function "
                          "returning the object), comma-separated")
    factory = resolve(name, {}, kind="callbacks")
    try:
        return factory()
    except Exception as err:  # noqa: BLE001 - the user's constructor: it is bad input here, before anything runs
        raise ConfigError(f"--callbacks {name}: {name.partition(':')[2]}() raised {type(err).__name__}: "
                          f"{first_line(err, 200)}; --callbacks makes each callback with no arguments (give its "
                          "arguments defaults, or pass the object with train(callbacks=[...]))") from None


def _instance(item: Any) -> Any:
    """``train(callbacks=)``: an object, or a class made with no arguments (as the Trainer takes either)."""
    if not inspect.isclass(item):
        return item
    try:
        return item()
    except Exception as err:  # noqa: BLE001 - as for --callbacks
        raise ConfigError(f"callbacks=[{item.__name__}]: {item.__name__}() raised {type(err).__name__}: "
                          f"{first_line(err, 200)}; pass an object (callbacks=[{item.__name__}(...)]) or give its "
                          "arguments defaults") from None


def _check(callback: Any) -> None:
    """A callback has at least one hook, and each of its hooks can be called as accel_ddp calls it."""
    name, present = _name(callback), [hook for hook in HOOKS if callable(getattr(callback, hook, None))]
    if not present:
        raise ConfigError(f"callback {name} has none of the hooks {', '.join(HOOKS)}; define at least one "
                          "(e.g. def on_step_end(self, state): ...)")
    trainer = any(base.__name__ == "TrainerCallback" for base in type(callback).__mro__)
    for hook in present:
        try:
            inspect.signature(getattr(callback, hook)).bind("state", *HOOKS[hook])
        except TypeError as err:
            expected = ", ".join(("state", *HOOKS[hook]))
            hint = (" (a transformers TrainerCallback's hooks take (args, state, control, **kwargs): write a plain "
                    "class)") if trainer else ""
            raise ConfigError(f"callback {name}.{hook} cannot be called as {hook}({expected}) ({err}){hint}; "
                              f"define it as def {hook}(self, {expected})") from None
        except ValueError:  # no signature to inspect (a builtin): let the call decide
            continue


def _warn_unknown_hooks(callback: Any) -> None:
    """A method named like a hook that is none (``on_epoch_end``, a typo): said once, not refused."""
    unknown = [attr for attr in dir(callback) if attr.startswith("on_") and attr not in HOOKS
               and callable(getattr(callback, attr, None))]
    if unknown:
        warn(f"callback {_name(callback)}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not called "
             f"(the hooks are {', '.join(HOOKS)})", ranks="every", above_bar=True)
