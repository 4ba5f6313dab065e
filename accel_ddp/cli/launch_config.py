"""The launch config ``accelerate launch`` would use: which file (found as Accelerate finds it), read how.

    source = resolve_config_file(None)            # --config_file, else Accelerate's default config, else none
    config = load_launch_config(source.path)      # Accelerate's loader, defaults filled in, enums as strings
    config = launch_defaults(facts)               # what `accelerate launch` runs without any file

A file that cannot be read at all is a ``DoctorInputError`` (``accel-ddp doctor`` exits 2).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from accel_ddp.cli.machine import MachineFacts


@dataclass(frozen=True)
class ConfigSource:
    """The launch config ``accelerate launch`` would use, and how it was found."""

    path: str | None  # None: no file, `accelerate launch` uses its built-in defaults
    origin: str       # for the report's first line
    flag: bool = True  # given with --config_file (the launch command must repeat it)

    def describe(self) -> str:
        return f"{self.path} ({self.origin})" if self.path else f"no config file ({self.origin})"


def resolve_config_file(config_file: str | None, cpu: bool = False) -> ConfigSource:
    """The file ``accelerate launch`` would read, found exactly as it finds it.

    ``--config_file`` if given; else Accelerate's default file, unless ``--cpu`` (then
    ``accelerate launch`` ignores it: accelerate/commands/launch.py, ``_validate_launch_command``).
    The default path is Accelerate's own constant: ``$HF_HOME/accelerate/default_config.yaml``,
    ``HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface``, itself ``~/.cache/huggingface``;
    ``accelerate config`` writes it there and no other variable moves it.
    """
    if config_file is not None:
        return ConfigSource(config_file, "given with --config_file")
    from accelerate.commands.config.config_args import default_config_file

    if cpu:
        return ConfigSource(None, f"--cpu without --config_file: `accelerate launch` ignores {default_config_file}",
                            flag=False)
    if os.path.isfile(default_config_file):
        return ConfigSource(default_config_file, "Accelerate's default config, written by `accelerate config`: what "
                            "`accelerate launch` reads without --config_file", flag=False)
    return ConfigSource(None, f"no --config_file, and no {default_config_file}, which `accelerate config` writes",
                        flag=False)


def launch_defaults(facts: MachineFacts) -> dict[str, Any]:
    """What ``accelerate launch`` runs with no config file: one process per GPU (DDP with 2 or more), fp32."""
    processes = max(facts.gpu_count, 1)
    return {"distributed_type": "MULTI_GPU" if processes > 1 else "NO", "num_processes": processes,
            "num_machines": 1, "machine_rank": 0, "mixed_precision": "no", "gpu_ids": "all"}


class DoctorInputError(ValueError):
    """The config file cannot be read at all (missing, bad YAML, unknown keys)."""


def load_launch_config(config_file: str, label: str = "--config_file") -> dict[str, Any]:
    """The file as ``accelerate launch`` sees it: Accelerate's loader, defaults filled in, enums as strings."""
    from accelerate.commands.config.config_args import load_config_from_file
    from yaml import YAMLError

    name = f"{label} {config_file}"
    try:
        config = load_config_from_file(config_file)
    except FileNotFoundError:
        raise DoctorInputError(f"{name}: no such file; give the path of an accelerate "
                               "config such as accelerate_configs/cpu_2proc.yaml") from None
    except YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise DoctorInputError(f"{name}: not valid YAML{where}; fix the file's syntax") from None
    except (ValueError, TypeError, AttributeError, KeyError) as err:
        raise DoctorInputError(f"{name}: Accelerate cannot load it ({err}); compare it with "
                               "accelerate_configs/4gpu.yaml, or run `accelerate config` again") from None
    values = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        values[f.name] = getattr(value, "value", value)  # enums -> their strings
    return values
