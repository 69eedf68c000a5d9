"""Flower's Deployment Engine: submit a run to a SuperLink, and a local federation to try it on one machine.

In deployment the ServerApp does not run in the ``privfl.train`` process. ``privfl.train --flower-mode
deployment`` checks its input, fixes the run folder's name, and submits a Flower App whose components
are privfl's own (``privfl.flower.server:app``, ``privfl.flower.node:app``) with the whole config as one
run-config value (``privfl-job``, JSON). The SuperLink starts the ServerApp, which trains exactly as in
simulation and writes the run folder on the SuperLink's machine (at the config's absolute ``out_dir``);
each SuperNode runs the ClientApp for the partition it was started with (``--node-config
'partition-id=K'``). The App holds no code: every machine needs privfl (and its dataset) installed, and
Flower's runtime dependency installation is not used.

``flwr run`` reads its connection settings from ``$FLWR_HOME/config.toml``; privfl writes them in a
temporary ``FLWR_HOME`` of its own, so a user's ``~/.flwr`` is neither read nor changed.

:class:`LocalFederation` starts one SuperLink and N SuperNodes on localhost as separate processes and
stops exactly those (by pid, and the helper processes they started, found through ``/proc``): what the
deployment test uses, and ``python -m privfl.flower.federation`` for users.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from privfl.errors import ConfigError, PrivflError

#: the run-config key that carries a privfl run's config to the ServerApp
JOB_KEY = "privfl-job"

APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "privfl-run"
version = "1.0.0"
description = "A privfl run: the ServerApp and ClientApp of the installed privfl package"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "privfl"

[tool.flwr.app.components]
serverapp = "privfl.flower.server:app"
clientapp = "privfl.flower.node:app"

[tool.flwr.app.config]
{key} = ""
"""


def flower_tool(name: str) -> str:
    """The path of a Flower command-line tool installed beside this Python (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ConfigError(f"Flower's {name} command is not installed: uv sync --extra flower (or: pip install 'privfl[flower]')")
    return found


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string (JSON's string escapes are a subset of TOML's)."""
    return json.dumps(text, ensure_ascii=True)


def check_deployment(cfg: Any) -> None:
    """What can be checked here before anything is created (one-line errors)."""
    host, sep, port = str(cfg.flower_superlink).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--flower-superlink must be HOST:PORT, got {cfg.flower_superlink!r}")
    if cfg.flower_root_certificates and cfg.flower_insecure:
        raise ConfigError("--flower-root-certificates and --flower-insecure exclude each other")
    if cfg.flower_root_certificates and not Path(cfg.flower_root_certificates).is_file():
        raise ConfigError(f"--flower-root-certificates: no file {cfg.flower_root_certificates}")
    if not cfg.flower_insecure and not cfg.flower_root_certificates:
        raise ConfigError("--flower-mode deployment needs --flower-root-certificates CA.pem (a SuperLink with TLS) or --flower-insecure")
    flower_tool("flwr")


def submit(cfg: Any, run_dir: Path, *, log: IO[str] | None = None) -> int:
    """Run ``cfg`` on the SuperLink of ``cfg.flower_superlink`` (the ServerApp creates ``run_dir`` there);
    streams Flower's log to ``log`` (stderr by default) and returns ``flwr run``'s exit status."""
    job = dataclasses.asdict(dataclasses.replace(cfg, out_dir=str(run_dir.parent.resolve()), run_name=run_dir.name))
    with tempfile.TemporaryDirectory(prefix="privfl-flower-") as tmp:
        app, home = Path(tmp) / "app", Path(tmp) / "home"
        app.mkdir()
        home.mkdir()
        (app / "pyproject.toml").write_text(APP_PYPROJECT.format(key=JOB_KEY))
        (app / "run-config.toml").write_text(f"{JOB_KEY} = {_toml_string(json.dumps(job, sort_keys=True))}\n")
        link = [f"address = {_toml_string(cfg.flower_superlink)}"]
        if cfg.flower_insecure:
            link.append("insecure = true")
        if cfg.flower_root_certificates:
            link.append(f"root-certificates = {_toml_string(str(Path(cfg.flower_root_certificates).resolve()))}")
        (home / "config.toml").write_text('[superlink]\ndefault = "privfl"\n\n[superlink.privfl]\n' + "\n".join(link) + "\n")
        command = [flower_tool("flwr"), "run", str(app), "privfl", "--stream", "--run-config", str(app / "run-config.toml")]
        env = {**os.environ, "FLWR_HOME": str(home)}
        done = subprocess.run(command, env=env, stdout=log or sys.stderr, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
        return done.returncode


# ---------------------------------------------------------------------------------------------- local federation
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere or once it is gone)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, counts as stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class LocalFederation:
    """A SuperLink and ``clients`` SuperNodes on 127.0.0.1, each a separate process, without TLS.

    Every process it starts (and every helper process those start, such as Flower's SuperExec and the
    ServerApp/ClientApp processes) is recorded by pid; :meth:`stop` ends exactly those and waits for
    them. Logs go to ``workdir/*.log``; Flower's own state (installed Apps) to ``workdir/flwr-home``."""

    def __init__(self, clients: int, workdir: Path, *, port: int | None = None, startup_timeout: float = 60.0):
        if clients < 1:
            raise ConfigError(f"a federation needs at least one client, got {clients}")
        self.clients, self.workdir = clients, Path(workdir)
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        self.processes: list[subprocess.Popen[bytes]] = []
        self.started: set[int] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, name: str, command: list[str]) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "FLWR_HOME": str(self.workdir / "flwr-home")}
        env["PATH"] = str(Path(flower_tool(command[0])).parent) + os.pathsep + env.get("PATH", "")  # Flower starts its helpers by name
        with open(self.workdir / f"{name}.log", "ab") as log:
            argv = [flower_tool(command[0]), *command[1:]]
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.processes.append(proc)
        self.started.add(proc.pid)

    def start(self) -> LocalFederation:
        link = ["flower-superlink", "--insecure", "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(self.port)]
        self._spawn("superlink", link)
        self._wait_listening(self.port, "the SuperLink")
        for k in range(self.clients):
            node = ["flower-supernode", "--insecure", "--superlink", self.address, "--host", "127.0.0.1", "--port", str(free_port())]
            self._spawn(f"supernode{k}", [*node, "--node-config", f"partition-id={k}"])
        return self

    def _wait_listening(self, port: int, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.processes):
                raise PrivflError(f"{what} exited while starting (see {self.workdir}/*.log)")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise PrivflError(f"{what} did not listen on port {port} within {self.startup_timeout:.0f} s (see {self.workdir}/*.log)")

    def pids(self) -> set[int]:
        """Every live process this federation started, directly or through Flower."""
        for proc in self.processes:
            self.started.update(descendants(proc.pid))
        return {pid for pid in self.started if alive(pid)}

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to every process it started (SuperNodes first), then SIGKILL to any still running."""
        self.pids()  # record the helpers before their parents go
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.pids():
            for proc in self.processes:
                proc.poll()  # reap
            time.sleep(0.2)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.processes:
            proc.wait(timeout=10)

    def __enter__(self) -> LocalFederation:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


__all__ = ["JOB_KEY", "LocalFederation", "check_deployment", "submit"]
