"""The command of a docs page generated below a marker line (the configuration reference, the sizing page): rewrite
the page, or with `--check` exit 1 when it is stale, changing nothing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def main(argv: list[str] | None, default: Path, page: Callable[[str], str], title: str, module: str, doc: str) -> int:
    """`page(current)` is the page with its generated part made anew; `title` starts a page that does not exist."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale, change nothing")
    parser.add_argument("--page", type=Path, default=default)
    args = parser.parse_args(argv)
    current = args.page.read_text() if args.page.exists() else title
    wanted = page(current)
    if args.check:
        if wanted != current:
            print(f"{args.page} is stale: run `python -m {module}`", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(wanted)
    print(f"wrote {args.page}")
    return 0
