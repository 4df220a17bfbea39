"""A server process a live target starts: free port, health wait, clean stop, kept log."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time

import requests

from .base import TargetRunError, TargetStartError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    """Runs `command` (which must bind 127.0.0.1:`port`) and waits for GET /health."""

    def __init__(self, command: list[str], port: int, start_timeout_s: float = 600.0,
                 env: dict | None = None, log_dir: str | None = None):
        self.command = command
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.start_timeout_s = start_timeout_s
        log_dir = log_dir or tempfile.mkdtemp(prefix="kvtune-server-")
        self.log_path = os.path.join(log_dir, "server.log")
        self._env = dict(os.environ, **(env or {}))
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ManagedServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self._env,
                                         start_new_session=True)  # its own group: we stop all it spawns
        except OSError as err:
            raise TargetStartError(f"cannot run {self.command[0]!r}: {err.strerror or err}") from err
        finally:
            log.close()
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TargetStartError(f"the server exited with status {self.proc.returncode} before it "
                                       f"was healthy; last log lines:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise TargetStartError(f"the server was not healthy at {self.url}/health after "
                               f"{self.start_timeout_s:.0f} s; last log lines:\n{self.log_tail()}")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise TargetRunError(f"the server died during the run (exit status {self.proc.returncode}); "
                                 f"last log lines:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""
