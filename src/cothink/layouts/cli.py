"""`cothink layout schema` and `cothink layout check FILE`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _cmd_schema(args: argparse.Namespace) -> int:
    from cothink.layouts.model import Layout

    print(json.dumps(Layout.model_json_schema(), indent=2))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from cothink.layouts.validate import check_text

    errors, layout = check_text(Path(args.file).read_text())
    if errors:
        for e in errors:
            print(f"{args.file}: {e}", file=sys.stderr)
        return 2
    assert layout is not None
    print(
        f"{args.file}: valid layout {layout.name!r} ({len(layout.coroutines)} coroutines, "
        f"{len(layout.blocks)} blocks)"
    )
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "layout",
        help="coroutine layouts as data: print the JSON Schema, validate a layout file",
        description="A layout describes coroutines (generate / probe / coordinator rule), the blocks each "
        "reads and writes, their triggers, priorities, stop conditions and outputs, as JSON.",
    )
    sub = p.add_subparsers(dest="layout_command", metavar="COMMAND", required=True)
    q = sub.add_parser("schema", help="print the layout JSON Schema")
    q.set_defaults(func=_cmd_schema)
    q = sub.add_parser("check", help="validate a layout JSON file (exit status 2 when invalid)")
    q.add_argument("file", metavar="FILE")
    q.set_defaults(func=_cmd_check)
    return p
