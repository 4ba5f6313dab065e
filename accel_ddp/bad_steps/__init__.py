"""Bad steps, in one room: an optimizer step whose loss or gradient norm is nan or inf, or (``--spike_factor``) whose
logged loss spiked. How one is found, what the run does (stop, skip, roll back, the spike's stop or rollback), what
it leaves behind (``OUTPUT_DIR/anomalies.json``, a line, a record, the rollback's reload) and its words.

    bad = BadSteps(section_of(cfg, BadStepOptions), accelerator, model, recorder)   # setup (assemble.py), once
    bad.begin(start_step, checkpoints, train_loader)     # once the start is agreed: anomalies.json continued
    steps = TrainStep(..., check_loss=bad.check_loss, guard=bad.step_guard)        # the step's hooks (assemble.py)
    bad.restart(start_step, steps.losses)                # each fit (again after a rollback): watched from here
    bad.step_done()                                      # AfterStep, once per optimizer step: no device work
    mean_loss = bad.logged_loss(step)                    # a log line's loss, the skipped steps left out
    bad.check(step)                                      # before each save and evaluation, and the final outputs

The default (``--on_anomaly stop``): each step's losses are kept on the device and checked (``LossWatch``) where
the loop syncs anyway: at a log line whose loss is not finite, before every evaluation and save, and before the
final outputs; every rank raises ``NonFiniteLoss`` (exit 3, nothing saved after the bad step). With ``--debug``
every micro-step's loss is checked before its backward, with a trace of the operation that made it. A ``(sum,
num_items)`` loss that summed over no items is refused at the same points (exit 2).

``--on_anomaly skip|rollback`` (``AnomalyGuard``): such a step is not trained on, on any rank; every decision is
recorded in ``anomalies.json``. Where the decision comes from, and what it costs:

- Per step, the decision is taken on the gradient norm after DDP's all-reduce (``step/update.py``). The
  gradients are then the same on every rank, and the norm is computed from them by the same kernels, so every
  rank takes the same decision without a collective of its own. A non-finite *local* loss is made a non-finite
  gradient on its rank (:meth:`AnomalyGuard.poisoned`, one multiply), which the all-reduce carries to all.
- With a fused optimizer (CUDA) the decision stays on the device: the optimizer's ``found_inf`` flag, the one
  GradScaler hands it (torch/amp/grad_scaler.py ``_maybe_opt_step``; torch/optim/adam.py reads
  ``getattr(self, "found_inf", None)``), makes its kernel return before it writes anything. Otherwise (the
  multi-tensor optimizers the CPU uses) one ``bool()`` of the flag per step: a no-op sync on the CPU, whose
  kernels run synchronously. The host reads the per-step flags where the loop syncs anyway (``AnomalyGuard.resolve``: at
  log lines, before saves and evaluations), prints one line per anomaly and writes its record.
- Spikes are judged at log lines on the logged loss (already all-reduced: the same float on every rank); that
  loss's updates are already applied, so a spike can only be stopped at or rolled back.

``rollback``: every rank reloads the last checkpoint from before the first bad step and replays from there with
the bad steps' updates left out; ``anomalies.json`` holds those steps, so a resumed run leaves out the same ones.

The step's device-side hooks stay in ``step/`` (the guarded update, the poisoned loss, a skipped step's loss kept
off the log): they run inside the step, between its backward and its update; what they consult is decided here.

    stops.py   BadStepOptions (the room's section of the options); the words and exceptions of a stop, one family
    watch.py   LossWatch: the first nan/inf loss, found on the device; --debug's trace of the operation that made it
    guard.py   AnomalyGuard: --on_anomaly skip|rollback and --spike_factor's decisions, anomalies.json
    room.py    BadSteps: the one entry, built by setup, given to the step, called by AfterStep

May import: util, config, lifecycle, outputs, tracking, checkpoint, step (and the layers between them). Built by
``assemble``, called by ``after_step`` and ``loop``.
"""

from accel_ddp.bad_steps.guard import AnomalyGuard
from accel_ddp.bad_steps.room import BadSteps
from accel_ddp.bad_steps.stops import AnomalyStop, BadStepOptions, RolledBack
from accel_ddp.bad_steps.watch import LossWatch, trace_non_finite

__all__ = ["AnomalyGuard", "AnomalyStop", "BadStepOptions", "BadSteps", "LossWatch", "RolledBack", "trace_non_finite"]
