"""Optional dependencies: imported only when a feature asks for them, else one line with the install command."""

from __future__ import annotations

import importlib
from types import ModuleType

from accel_ddp.util.validation import ConfigError

# package -> setup.cfg extra
EXTRAS = {"transformers": "nlp", "tokenizers": "nlp", "tensorboard": "tracking", "torchvision": "vision",
          "peft": "finetune"}


def require(package: str, feature: str) -> ModuleType:
    """Import ``package`` for ``feature`` (e.g. ``"--tokenizer"``), or raise a ConfigError saying how to install it.

        >>> require("math", "--lr").pi > 3
        True
    """
    try:
        return importlib.import_module(package)
    except ImportError:
        extra = EXTRAS.get(package)
        how = f"pip install 'accel_ddp[{extra}]' (or pip install {package})" if extra else f"pip install {package}"
        raise ConfigError(f"{feature} needs the {package} package, which is not installed; {how}") from None


def import_quietly(*packages: str) -> None:
    """Import what is installed of ``packages`` ahead of its use, saying nothing about what is not: its user
    ``require``s it later and reports a missing one there, as one line."""
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError:
            pass
