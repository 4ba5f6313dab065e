"""Which installed trackers ``--report_to all`` starts: those configured to run on this machine.

``all`` right after ``pip install -e ".[test]"`` (W&B and MLflow installed, no account) must train,
not stop on "W&B not logged in". A tracker that needs an account or a server is configured when the
settings it would read say where to log (read here without importing it: W&B's lookup is
wandb/sdk/lib/wbauth/authenticate.py ``_use_system_auth``, its netrc one wbnetrc.py); the
file-based ones always are. The others are left out of ``all`` and named in one line with what to
set. A tracker named in ``--report_to`` starts whatever this says, and stops the run if it cannot.

    >>> unconfigured("wandb")   # None when it would start, else what to set: "set WANDB_API_KEY or ..."
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlsplit

_TRUE = ("1", "true", "yes", "on")


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _netrc_has(host_url: str) -> bool:
    """Does the netrc file (``NETRC``, else ~/.netrc or ~/_netrc, as W&B looks) hold a password for this host?"""
    path = Path(_env("NETRC")).expanduser() if _env("NETRC") else next(
        (p for p in (Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()) if p.exists()), None)
    host = urlsplit(host_url).netloc
    if path is None or not host or not path.exists():
        return False
    try:
        creds = netrc.netrc(str(path)).authenticators(host)
    except (netrc.NetrcParseError, OSError):
        return False  # W&B warns and reads no key from it either
    return bool(creds and creds[2])


def _wandb() -> bool:
    if _env("WANDB_MODE").lower() in ("offline", "dryrun", "disabled") or _env("WANDB_DISABLED").lower() in _TRUE:
        return True
    return bool(_env("WANDB_API_KEY") or _env("WANDB_IDENTITY_TOKEN_FILE")
                or _netrc_has(_env("WANDB_BASE_URL") or "https://api.wandb.ai"))


def _comet() -> bool:
    config = Path(_env("COMET_CONFIG") or "~/.comet.config").expanduser()
    return bool(_env("COMET_API_KEY")) or config.is_file()


def _clearml() -> bool:
    config = Path(_env("CLEARML_CONFIG_FILE") or "~/clearml.conf").expanduser()
    keys = _env("CLEARML_API_ACCESS_KEY") and _env("CLEARML_API_SECRET_KEY")
    return bool(keys) or config.is_file() or _env("CLEARML_OFFLINE_MODE").lower() in _TRUE


def _swanlab() -> bool:
    return bool(_env("SWANLAB_API_KEY")) or _env("SWANLAB_MODE").lower() in ("offline", "local", "disabled") \
        or Path("~/.swanlab/.netrc").expanduser().is_file()


# name -> (is it configured here?, what to set when it is not). Trackers missing here write files only
# (tensorboard, csv, aim and dvclive into OUTPUT_DIR, trackio into OUTPUT_DIR/trackio unless TRACKIO_DIR):
# always configured.
CONFIGURED = {
    "wandb": (_wandb, "set WANDB_API_KEY or run `wandb login`, or WANDB_MODE=offline to log locally"),
    "mlflow": (lambda: bool(_env("MLFLOW_TRACKING_URI")), "set MLFLOW_TRACKING_URI"),
    "comet_ml": (_comet, "set COMET_API_KEY or run `comet login`"),
    "clearml": (_clearml, "run `clearml-init` or set CLEARML_API_ACCESS_KEY and CLEARML_API_SECRET_KEY"),
    "swanlab": (_swanlab, "set SWANLAB_API_KEY or run `swanlab login`, or SWANLAB_MODE=offline"),
}


def unconfigured(name: str) -> str | None:
    """None when tracker ``name`` is configured to run here, else what to set to enable it."""
    check, fix = CONFIGURED.get(name, (lambda: True, ""))
    return None if check() else fix


def skipped_line(skipped: list[str]) -> str:
    """The one line naming the trackers ``all`` left out, each with what enables it."""
    named = ", ".join(f"{name} ({CONFIGURED[name][1]})" for name in skipped)
    return f"--report_to all: not logging to {named}; name a tracker in --report_to to require it"
