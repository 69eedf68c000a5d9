"""Shared CLI plumbing: user errors become one line on stderr and exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from privfl.errors import PrivflError


def run_cli(prog: str, main: Callable[[], int | None]) -> int:
    try:
        return int(main() or 0)
    except PrivflError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; resume with --resume", file=sys.stderr)
        return 130
