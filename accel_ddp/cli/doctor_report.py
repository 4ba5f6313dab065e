"""What ``accel-ddp doctor`` prints: findings at three levels, each ``problem -> fix``, and the report around them
(the file checked, the machine, the versions, the launch commands). What each level means: doctor.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accel_ddp.cli.launch_config import ConfigSource
from accel_ddp.cli.machine import MachineFacts

ERROR, WARNING, NOTE = "error", "warning", "note"


@dataclass(frozen=True)
class Finding:
    level: str    # error, warning or note
    problem: str
    fix: str

    def line(self) -> str:
        return f"{self.level.upper():<7}  {self.problem} -> {self.fix}"


@dataclass
class Report:
    source: ConfigSource
    facts: MachineFacts
    summary: str = ""
    findings: list[Finding] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)  # software_versions(); empty in tests
    footnotes: list[str] = field(default_factory=list)  # facts about the launch itself, printed under it

    @property
    def ok(self) -> bool:
        return not any(f.level == ERROR for f in self.findings)

    def add(self, level: str, problem: str, fix: str) -> None:
        self.findings.append(Finding(level, problem, fix))

    def render(self) -> str:
        counts = {lvl: sum(f.level == lvl for f in self.findings) for lvl in (ERROR, WARNING, NOTE)}
        verdict = "ready" if self.ok else "will not run as intended"
        lines = [f"accel-ddp doctor: {self.source.describe()}", f"  machine:  {self.facts.describe()}"]
        if self.versions:
            lines.append("  software: " + ", ".join(f"{name} {version}" for name, version in self.versions.items()))
        lines += [f"  config:   {self.summary}", ""]
        lines += [f.line() for f in self.findings] or ["OK       no problems found"]
        lines += ["", f"{verdict}: {counts[ERROR]} error(s), {counts[WARNING]} warning(s), {counts[NOTE]} note(s)"]
        head = "launch with:" if self.ok else "launch with (once the errors above are fixed):"
        lines += [head, *(f"  {cmd}" for cmd in self.commands)]
        lines += [f"note: {text}" for text in self.footnotes]
        return "\n".join(lines)
