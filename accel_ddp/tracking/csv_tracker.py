"""``CSVTracker``: ``OUTPUT_DIR/metrics.csv`` through Accelerate's tracker API (Accelerate 1.x has no CSV tracker)."""

from __future__ import annotations

import csv
import io
import os
from typing import Any

from accelerate.tracking import GeneralTracker, on_main_process

from accel_ddp.outputs.metrics_file import damaged_line
from accel_ddp.outputs.names import CSV_NAME
from accel_ddp.util.atomic import atomic_write_text
from accel_ddp.util.validation import ConfigError


class CSVTracker(GeneralTracker):
    """``OUTPUT_DIR/metrics.csv``, one row per logged step: Accelerate 1.x has no CSV tracker.

    Passed to ``Accelerator(log_with=[...])`` as an instance, so nothing is registered globally.
    Columns grow as new keys appear (eval metrics arrive after the first loss lines): the file is
    then rewritten with the wider header. An existing file is extended; with ``keep_until`` (the
    step a run resumes from, 0 for a fresh one) its rows past that step go first, as in metrics.jsonl.
    """

    name = "csv"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, output_dir: str, keep_until: int | None = None):
        super().__init__()
        self.path = os.path.join(output_dir, CSV_NAME)
        self.keep_until = keep_until
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []
        self._rewrite = False  # rows past keep_until were dropped: the file is rewritten at the next record

    @on_main_process
    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if os.path.isfile(self.path):
            with open(self.path, "rb") as fh:
                raw = fh.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:  # damage: the run only writes UTF-8
                raise ConfigError(damaged_line(self.path, raw.count(b"\n", 0, err.start) + 1)) from None
            reader = csv.DictReader(io.StringIO(text, newline=""))
            self.columns = list(reader.fieldnames or ["step"])
            self.rows = list(reader)
            if self.keep_until is not None:
                kept = [r for r in self.rows if r.get("step", "").isdigit() and int(r["step"]) <= self.keep_until]
                if len(kept) < len(self.rows):  # rewritten at the first record: a failed start changes nothing
                    self.rows, self._rewrite = kept, True

    @property
    def tracker(self) -> str:
        return self.path

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """The config lives in config.yaml already; a CSV of metrics has no place for it."""

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        row = {"step": "" if step is None else step}
        for key, value in values.items():
            if isinstance(value, dict):  # TensorBoard-style grouped scalars
                row.update({f"{key}/{sub}": v for sub, v in value.items()})
            else:
                row[key] = value.item() if hasattr(value, "item") else value
        new = [k for k in row if k not in self.columns]
        self.rows.append(row)
        if new or self._rewrite or not os.path.isfile(self.path):
            self.columns += new
            self._rewrite = False
            atomic_write_text(self.path, self._render(self.rows, header=True))
        else:
            with open(self.path, "a", newline="", encoding="utf-8") as fh:
                fh.write(self._render([row], header=False))

    def _render(self, rows: list[dict[str, Any]], header: bool) -> str:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self.columns, restval="", lineterminator="\n")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()


