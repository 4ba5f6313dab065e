"""``accel-ddp``: the commands around training (training itself goes through ``accelerate launch``).

    accel-ddp summary OUTPUT_DIR     print a finished run's summary as a table
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _summary(args: argparse.Namespace) -> int:
    path = os.path.join(args.output_dir, "summary.json")
    if not os.path.isfile(path):
        print(f"accel-ddp: error: no summary.json in {args.output_dir}; point at a finished run's --output_dir",
              file=sys.stderr)
        return 2
    with open(path, encoding="utf-8") as fh:
        summary = json.load(fh)
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accel-ddp", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="print a run's summary.json as a table")
    summary.add_argument("output_dir")
    summary.set_defaults(func=_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
