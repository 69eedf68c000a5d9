"""Shared CLI plumbing: user errors become one line on stderr and exit status 2; ``--plugin`` modules."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from privfl.errors import ConfigError, PrivflError


def run_cli(prog: str, main: Callable[[], int | None]) -> int:
    try:
        return int(main() or 0)
    except PrivflError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; resume with --resume", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`... | head`): not an error of ours; silence the flush at exit
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


PLUGIN_HELP = "import this module first (repeatable): your package's methods, kinds, attacks and defenses register on import"


def load_plugins(argv: Sequence[str]) -> list[str]:
    """Import every ``--plugin MODULE`` (or ``--plugin=MODULE``) named in ``argv`` before the parser is
    built, so what the modules register (kinds, defenses, attacks, methods) is known to it. Returns the
    modules imported; an import that fails is a one-line :class:`ConfigError`."""
    modules: list[str] = []
    it = iter(range(len(argv)))
    for i in it:
        arg = argv[i]
        if arg == "--plugin" and i + 1 < len(argv):
            modules.append(argv[i + 1])
            next(it, None)
        elif arg.startswith("--plugin="):
            modules.append(arg.split("=", 1)[1])
    for name in modules:
        if not name or name.startswith("-"):
            raise ConfigError(f"--plugin takes an importable module name, got {name!r}")
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"cannot import --plugin {name}: {exc}") from None
    return modules
