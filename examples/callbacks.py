"""Two callbacks (docs/tasks.md#callbacks): early stopping on a target accuracy, and a few lines at its moments.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml train.py --dataset digits --eval_every 10 \
        --callbacks examples.callbacks:StopAtAccuracy,examples.callbacks:Milestones --output_dir outputs/callbacks

or from Python: ``train(cfg, callbacks=[StopAtAccuracy(0.95), Milestones()])``. Every hook runs on every rank: print
on the main process only (through ``tqdm.write``: the progress bar is tqdm's), and make no collective of your own
unless every rank makes it at the same hook.
"""

from tqdm.auto import tqdm


class StopAtAccuracy:
    """Once an evaluation reaches ``target`` accuracy, every rank saves that step and stops (the run then finishes:
    final weights, summary.json with ``stopped_early``)."""

    def __init__(self, target: float = 0.95):
        self.target = target

    def on_evaluate(self, state, metrics):
        # The metrics are gathered over every rank: each rank decides alike (one asking would be enough).
        if (metrics.get("eval_accuracy") or 0.0) >= self.target:
            state.should_save = state.should_stop = True


class Milestones:
    """A line where the run starts, at each checkpoint, and at its end (main process)."""

    def on_train_begin(self, state):
        if state.is_main_process:
            tqdm.write(f"[callback] training from step {state.step} of {state.max_steps}")

    def on_save(self, state, checkpoint_dir):
        if state.is_main_process:
            tqdm.write(f"[callback] step {state.step} (epoch {state.epoch}) saved in {checkpoint_dir}")

    def on_train_end(self, state, summary):
        if state.is_main_process:
            why = summary.get("stopped_early", {}).get("reason", "its last step")
            tqdm.write(f"[callback] ended at step {state.step}, eval accuracy {summary['eval_accuracy']:.3f} ({why})")
