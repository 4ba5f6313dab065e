"""A trained run found on disk for ``evaluate`` and ``predict``: a finished run folder or one of its checkpoints.

    trained = find_trained("outputs/run")                                   # the final model.safetensors
    trained = find_trained("outputs/run/checkpoints/step_00000040")        # that checkpoint's weights
    trained.options, trained.weights, trained.checkpoint, trained.step

Only what can be told without torch is checked here (the folder's layout, config.yaml's options read back:
``config/saved.py``): a path that holds no finished run or checkpoint is one ``ConfigError`` line before anything heavy
is imported. The checkpoint's files are proven whole later, against its manifest (``checkpoint/manifest.py``), and
every weights file is checked key by key as it loads (``checkpoint/weights.py``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml

from accel_ddp.config.saved import REPLAYED_KEYS, saved_config
from accel_ddp.outputs.names import CHECKPOINTS_DIR, CONFIG_NAME, MARKER_NAME, SUMMARY_NAME, WEIGHTS_NAME
from accel_ddp.util import yaml_text
from accel_ddp.util.messages import first_line
from accel_ddp.util.validation import ConfigError

_STEP_DIR = re.compile(r"^step_(\d{8,})$")  # checkpoint/manifest.py's checkpoint_name
WHAT = "give a finished run's --output_dir, or one of its checkpoints/step_* folders"


@dataclass(frozen=True)
class TrainedRun:
    """A run's saved config and the weights to evaluate: the final ones, or a checkpoint's."""

    output_dir: str
    options: dict[str, Any]  # config.yaml's options (checked: config/saved.py reads them back); --data_dir replaced
    facts: dict[str, Any]  # config.yaml's ``resolved:`` section (world size, loader, ...)
    weights: str  # the safetensors file to load
    checkpoint: str | None  # the checkpoint folder (its manifest is checked before the load), or None: final weights
    step: int | None  # optimizer steps the weights were trained for (summary.json's, or the checkpoint's)

    @property
    def config_file(self) -> str:
        """The run's config.yaml, which ``options`` were read from."""
        return os.path.join(self.output_dir, CONFIG_NAME)


def find_trained(path: str, data_dir: str | None = None) -> TrainedRun:
    """The run at ``path`` (a finished run folder, or a complete checkpoint folder in one), with its config.

    ``data_dir``: where the run's data is now, if not at its recorded ``--data_dir``. A ConfigError line for a
    path that is missing, holds neither, or whose config.yaml cannot be read back.
    """
    path = os.path.normpath(path)
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such folder; {WHAT}")
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is a file, not a folder; {WHAT}")
    if _STEP_DIR.match(os.path.basename(path)) or os.path.isfile(os.path.join(path, MARKER_NAME)):
        return _checkpoint(path, data_dir)
    summary = _read_json(os.path.join(path, SUMMARY_NAME))
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        raise ConfigError(f"{path} holds no finished run or checkpoint (no {CONFIG_NAME}); {WHAT}")
    weights = os.path.isfile(os.path.join(path, WEIGHTS_NAME))
    if summary is None or not weights:
        missing = " and ".join(name for name, there in ((SUMMARY_NAME, summary is not None), (WEIGHTS_NAME, weights))
                               if not there)
        raise ConfigError(f"{path} holds no finished run (no {missing}: still training, or stopped before its end); "
                          f"{_newest_checkpoint_hint(path)}")
    options, facts = read_config(path, data_dir)
    # --load_best_model_at_end: the final weights are the best step's (checkpoint/best.py's final_weights_step)
    step = summary.get("final_weights_step", summary.get("optimizer_steps"))
    return TrainedRun(path, options, facts, os.path.join(path, WEIGHTS_NAME), None,
                      step if type(step) is int else None)


def _checkpoint(path: str, data_dir: str | None) -> TrainedRun:
    if not os.path.isfile(os.path.join(path, MARKER_NAME)):
        raise ConfigError(f"{path} is an incomplete checkpoint (no {MARKER_NAME}: its save never finished); give a "
                          "complete one, or the run's --output_dir")
    parent = os.path.dirname(path)
    output_dir = os.path.dirname(parent)
    if os.path.basename(parent) != CHECKPOINTS_DIR or not os.path.isfile(os.path.join(output_dir, CONFIG_NAME)):
        raise ConfigError(f"{path}: a checkpoint outside its run folder (its options are OUTPUT_DIR/{CONFIG_NAME}, "
                          f"for OUTPUT_DIR/{CHECKPOINTS_DIR}/step_*); give it inside the run folder that saved it")
    match = _STEP_DIR.match(os.path.basename(path))
    options, facts = read_config(output_dir, data_dir)
    return TrainedRun(output_dir, options, facts, os.path.join(path, WEIGHTS_NAME), path,
                      int(match.group(1)) if match else None)


def read_config(output_dir: str, data_dir: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``OUTPUT_DIR/config.yaml``'s options, checked to read back as the run's config (``config/saved.py``), and its
    ``resolved:`` facts (ConfigError: unreadable, or an option this version does not take)."""
    config = os.path.join(output_dir, CONFIG_NAME)
    try:
        with open(config, encoding="utf-8") as fh:
            values = yaml_text.load(fh)
    except (OSError, ValueError, yaml.YAMLError) as err:  # UnicodeDecodeError is a ValueError
        raise ConfigError(f"{config} is unreadable ({type(err).__name__}: {first_line(err, 120)}); the run's options "
                          "cannot be read back from it: restore it, or evaluate another run") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{config} holds no mapping of options ({type(values).__name__}); restore the run's "
                          f"{CONFIG_NAME}")
    facts = values.get("resolved") if isinstance(values.get("resolved"), dict) else {}
    options = {key: value for key, value in values.items() if key not in REPLAYED_KEYS}
    if data_dir is not None:
        options["data_dir"] = data_dir
    saved_config(options, config)  # refused now, before torch, rather than once the process group stands
    return options, facts


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _newest_checkpoint_hint(output_dir: str) -> str:
    """Where to evaluate instead: the newest complete checkpoint, if any."""
    root = os.path.join(output_dir, CHECKPOINTS_DIR)
    try:
        names = sorted(name for name in (os.listdir(root) if os.path.isdir(root) else ())
                       if _STEP_DIR.match(name) and os.path.isfile(os.path.join(root, name, MARKER_NAME)))
    except OSError:  # a folder we may not list: no hint, the line stays one line
        names = []
    if names:
        return f"give one of its checkpoints, e.g. {os.path.join(root, names[-1])}"
    return "and it has no complete checkpoint either; train it to its end (or with --checkpointing_steps) first"
