"""``python -m privfl.flower.federation --clients N``: a Flower deployment on this machine, for trying
``--flower-mode deployment`` before spreading it over machines (docs/scale.md).

Starts one SuperLink and N SuperNodes (partition-ids 0..N-1) as separate processes without TLS, prints
the ``privfl.train`` options that reach them, and on Ctrl-C (or SIGTERM) stops exactly the processes
it started."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import threading
from pathlib import Path

from privfl.cli import run_cli
from privfl.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m privfl.flower.federation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, required=True, help="SuperNodes to start (one per client of the run)")
    parser.add_argument("--port", type=int, default=None, help="the SuperLink's port (default: a free one)")
    parser.add_argument("--workdir", default=None, help="where logs and Flower's state go (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if args.clients < 1:
        raise ConfigError(f"--clients must be at least 1, got {args.clients}")
    from privfl.flower import require_flower
    from privfl.flower.deploy import LocalFederation

    require_flower()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="privfl-federation-"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalFederation(args.clients, workdir, port=args.port) as fed:
        print(f"SuperLink at {fed.address}, {args.clients} SuperNodes; pids {sorted(fed.pids())}; logs in {workdir}")
        flags = f"--num-clients {args.clients} --engine flower --flower-mode deployment --flower-insecure --flower-superlink {fed.address}"
        print(f"train on it: python -m privfl.train METHOD {flags}")
        print("Ctrl-C stops them", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    print("stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("privfl.flower.federation", main))
