"""How each tracker of ``--report_to`` is built: its project, run name, folder and resume state.

Every tracker writes inside the output folder (or where its own settings say): W&B's run files in
``OUTPUT_DIR/wandb/`` unless ``WANDB_DIR``, MLflow's store in ``OUTPUT_DIR/mlflow.db`` unless
``MLFLOW_TRACKING_URI``, DVCLive in ``OUTPUT_DIR/dvclive/`` without touching the user's checkout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from accelerate.tracking import GeneralTracker

from accel_ddp.outputs.names import MLFLOW_STORE, TENSORBOARD_SUBDIR
from accel_ddp.tracking.csv_tracker import CSVTracker


@dataclass
class TrackerRun:
    """Where a tracker writes and what it continues; known once the run has agreed where it starts."""

    output_dir: str
    project: str  # --tracker_project_name
    name: str  # --run_name, default the output folder's name
    start_step: int = 0  # the step resumed from; 0 for a fresh run
    saved: dict[str, Any] = field(default_factory=dict)  # this tracker's entry of trackers.json (resumes only)


def new_tracker(name: str, run: TrackerRun) -> GeneralTracker:
    """Accelerate's tracker ``name``, with this run's project, run name, folder and resume state."""
    from accelerate import tracking

    if name == "csv":
        return CSVTracker(run.output_dir, keep_until=run.start_step)
    if name == "tensorboard":  # same folder; events logged after the checkpoint are purged from TensorBoard's view
        return tracking.TensorBoardTracker(TENSORBOARD_SUBDIR, run.output_dir, purge_step=run.start_step + 1)
    if name == "wandb":
        where = {} if os.environ.get("WANDB_DIR") else {"dir": run.output_dir}  # OUTPUT_DIR/wandb/, not ./wandb/
        return tracking.WandBTracker(run.project, name=run.name, id=run.saved.get("id"), resume="allow", **where)
    if name == "mlflow":  # MLFLOW_TRACKING_URI says where; MLFLOW_EXPERIMENT_NAME and MLFLOW_RUN_ID win (Accelerate)
        return _mlflow_tracker(run)
    if name == "aim":  # an Aim repository in OUTPUT_DIR, as Accelerate does with project_dir
        return tracking.AimTracker(run.name, run.output_dir, experiment=run.project)
    if name == "clearml":
        return tracking.ClearMLTracker(run.project, project_name=run.project, task_name=run.name)
    if name == "dvclive":
        return _dvclive_tracker(os.path.join(run.output_dir, "dvclive"))
    if name == "swanlab":
        return tracking.SwanLabTracker(run.project, experiment_name=run.name)
    if name == "trackio":  # its database in the output folder unless TRACKIO_DIR says where (read at its import)
        os.environ.setdefault("TRACKIO_DIR", os.path.join(os.path.abspath(run.output_dir), "trackio"))
        return tracking.TrackioTracker(run.project, name=run.name)
    return tracking.CometMLTracker(run.project)  # comet_ml: it names the experiment itself


def _mlflow_tracker(run: TrackerRun) -> GeneralTracker:
    """MLflow's tracker; without MLFLOW_TRACKING_URI, MLflow's default store (sqlite:///mlflow.db in the working
    directory, DEFAULT_TRACKING_URI in mlflow/store/tracking/__init__.py) moves into the output folder."""
    from accelerate import tracking

    own_store = not os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    tracker = tracking.MLflowTracker(experiment_name=run.project, run_id=run.saved.get("run_id"), run_name=run.name,
                                     logging_dir=os.path.join(os.path.abspath(run.output_dir), "mlruns")
                                     if own_store else None)  # a new experiment's artifacts, beside its store
    if own_store:
        start = tracker.start

        def start_in_output_dir() -> None:
            import mlflow

            mlflow.set_tracking_uri(f"sqlite:///{os.path.abspath(os.path.join(run.output_dir, MLFLOW_STORE))}")
            start()

        tracker.start = start_in_output_dir
    return tracker


def _dvclive_tracker(folder: str) -> GeneralTracker:
    """DVCLive writing ``folder`` only: no experiment saved as a git ref, no dvc.yaml, no report (``Live``'s
    ``save_dvc_exp``, ``dvcyaml``, ``report``); and no DVC repository made in the user's checkout:
    ``Live()`` calls ``get_dvc_repo()``, which runs ``Repo.init`` in the git root when there is none
    (dvclive/dvc.py), whatever ``save_dvc_exp`` says; without a repository it logs files only."""
    from accelerate import tracking

    tracker = tracking.DVCLiveTracker(dir=folder, save_dvc_exp=False, dvcyaml=None, report=None)
    start = tracker.start

    def start_without_dvc() -> None:
        import dvclive.live as live_module

        found = getattr(live_module, "get_dvc_repo", None)
        if found is not None:  # the call's name in dvclive/live.py; an older dvclive without it makes none
            live_module.get_dvc_repo = lambda: None
        try:
            start()
        finally:
            if found is not None:
                live_module.get_dvc_repo = found

    tracker.start = start_without_dvc
    return tracker


