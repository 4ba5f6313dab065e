"""`accel-ddp doctor` checks of a config file on a simulated machine, and finding the one finding a test expects."""

from __future__ import annotations

from accel_ddp.cli import doctor
from accel_ddp.cli.doctor import diagnose


def never_in_use(port: int) -> bool:
    return False


def check_file(path, facts, **kwargs) -> doctor.Report:
    kwargs.setdefault("is_port_in_use", never_in_use)
    return diagnose(None if path is None else str(path), facts, **kwargs)  # None: what `accelerate launch` reads


def only(report: doctor.Report, level: str, *words: str) -> doctor.Finding:
    """The single finding of ``level`` whose line mentions every word."""
    hits = [f for f in report.findings if f.level == level and all(w in f.line() for w in words)]
    assert len(hits) == 1, f"expected one {level} with {words}, got:\n{report.render()}"
    assert " -> " in hits[0].line() and hits[0].fix  # every finding says how to fix it
    return hits[0]
