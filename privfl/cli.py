"""Shared CLI plumbing: user errors become one line on stderr and exit status 2; ``--plugin`` modules.

What :func:`run_cli` turns into one line (``prog: error: MSG``) and status 2: a :class:`PrivflError`
(bad input), an argument the parser refuses (:class:`ArgumentParser`), and a full disk, exceeded quota,
read-only file system or refused permission while reading or writing (``OSError`` with errno ENOSPC,
EDQUOT, EROFS, EACCES or EPERM; safetensors' own I/O errors alike), which names the path and, where the
command attached one, how to continue (``privfl.train``: the run keeps its last complete round and
``--resume --run RUN`` continues it). A reader that goes away (``... | head``) ends the command quietly
with status 0, ``--help`` included. Ctrl-C is status 130.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from privfl.errors import ConfigError, PrivflError

#: errno values of a disk or permission problem the user can fix and then continue
DISK_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM") if hasattr(errno, name))

#: the attribute a command sets on such an OSError to say how to continue (:func:`add_hint`)
HINT_ATTR = "privfl_hint"


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose refusals are one-line :class:`ConfigError` s (not the usage block and
    ``sys.exit``), so :func:`run_cli` prints them like every other bad input. Subparsers inherit it."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")


def add_hint(exc: BaseException, hint: str) -> None:
    """Attach ``hint`` (how to continue, one sentence) to ``exc``; :func:`run_cli` appends it to the error line."""
    setattr(exc, HINT_ATTR, hint)


def disk_error(exc: BaseException) -> str | None:
    """The one line for a full disk / quota / read-only / permission error, or None for any other exception.

    Safetensors reports I/O failures as ``SafetensorError(... (os error 28) at path "...")``, not as OSError."""
    if isinstance(exc, OSError):
        if exc.errno is None or exc.errno not in DISK_ERRNOS:
            return None
        code, paths = exc.errno, [p for p in (exc.filename, exc.filename2) if p is not None]
    elif type(exc).__name__ == "SafetensorError":
        found = re.search(r"\(os error (\d+)\)", str(exc))
        if found is None or int(found.group(1)) not in DISK_ERRNOS:
            return None
        code = int(found.group(1))
        where = re.search(r'at path "([^"]*)"', str(exc))
        paths = [where.group(1)] if where else []
    else:
        return None
    text = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    text += f": {' -> '.join(os.fsdecode(p) for p in paths)}" if paths else " (the path was not reported)"
    hint = getattr(exc, HINT_ATTR, None)
    return f"{text}; {hint}" if hint else text


def run_cli(prog: str, main: Callable[[], int | None]) -> int:
    """Run ``main`` and return its exit status; see the module docstring for what becomes one line."""
    try:
        try:
            code = int(main() or 0)
        except SystemExit as exc:  # --help and --version exit from inside parse_args: flush below, as for a return
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
    except PrivflError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; resume with --resume", file=sys.stderr)
        code = 130
    except BrokenPipeError:
        code = 0  # the reader went away (`... | head`): not an error of ours
        _silence_stdout()
    except Exception as exc:
        line = disk_error(exc)
        if line is None:
            raise  # an internal bug keeps its traceback
        print(f"{prog}: error: {line}", file=sys.stderr)
        code = 2
    try:  # what is still buffered goes now, so a closed pipe is seen here and not at interpreter exit
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    except (OSError, ValueError):  # stdout closed or failing otherwise: nothing more can be said there
        pass
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of what is still buffered cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout (captured in tests): nothing to silence
        pass


#: modules (and so their submodules) the user named with --plugin in this process
NAMED_MODULES: set[str] = set()

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
        NAMED_MODULES.add(name)  # the user named it: a run's `name.sub:Class` method may be imported
    return modules
