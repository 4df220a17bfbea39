"""A server process a live target starts: free port, health wait, clean stop, kept log.

A failed start raises TargetStartError whose message leads with the line of the
server's log that says why (startlog.root_cause), then the log's last lines,
then `full log: PATH`; that log is never deleted. Each start writes a log of its
own (`new_log`), so a folder that several starts share keeps every one. A server given no folder
logs to a temporary one of its own, removed when the server had been healthy and kvtune stopped it:
nothing will ever name that log, and a search starts dozens of servers. A failed start, or a server
that died on its own, keeps its folder (the error names the log).
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from ..httpclient import HTTP_ERRORS, http_get
from ..stopping import spawn
from .base import TargetRunError, TargetStartError
from .startlog import log_tail, read_log, root_cause

START_TAIL_LINES = 10  # log lines a start error quotes after its root cause
LOG_NUMBER = re.compile(r"^server-(\d+)[-.]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_log(log_dir: str, label: str = "") -> str:
    """A new, empty log file for one server start in `log_dir` (made if missing):
    `server-NNNN-LABEL.log`, NNNN one more than the highest number in the folder, so the names
    sort in start order. The number is taken under a lock on the folder and the file created
    exclusively: kvtune processes that share the folder never take one number or write one file."""
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._-")
    try:
        os.makedirs(log_dir, exist_ok=True)
        folder = os.open(log_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        raise TargetStartError(f"cannot keep the server's log in {log_dir}: {err.strerror or err}") from err
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # released when the folder is closed
        while True:
            taken = (int(m.group(1)) for name in os.listdir(log_dir) if (m := LOG_NUMBER.match(name)))
            path = os.path.join(log_dir, f"server-{max(taken, default=0) + 1:04d}{'-' * bool(label)}{label}.log")
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                return path
            except FileExistsError:  # made by a writer that takes no lock
                continue
    except OSError as err:
        raise TargetStartError(f"cannot write the server's log in {log_dir}: {err.strerror or err}") from err
    finally:
        os.close(folder)


def start_error(what: str, log_path: str) -> TargetStartError:
    """`what` happened before the server was healthy: an error that leads with the root-cause line of
    the log at `log_path`, quotes the log's last lines and ends with `full log: PATH` (the log is kept)."""
    cause = root_cause(read_log(log_path))
    tail = log_tail(log_path, START_TAIL_LINES).rstrip("\n")
    lines = [cause] if cause else []
    lines.append(f"{what}; last log lines:" if tail else f"{what}; the log is empty")
    if tail:
        lines.append(tail)
    lines.append(f"full log: {log_path}")
    return TargetStartError("\n".join(lines), cause=cause, log_path=log_path)


class ManagedServer:
    """Runs `command` (which must bind 127.0.0.1:`port`) and waits for GET /health.
    Each start logs to a new file in `log_dir` (default: a new temporary folder, removed on a clean
    stop), named with `log_label` (what was started: the server and its config); `log_path` is that
    file once started."""

    def __init__(self, command: list[str], port: int, start_timeout_s: float = 600.0,
                 env: dict | None = None, log_dir: str | None = None, log_label: str = ""):
        self.command = command
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.start_timeout_s = start_timeout_s
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvtune-server-")
        self._own_log_dir = log_dir is None
        self._healthy = False  # answered /health since its last start
        self.log_label = log_label
        self.log_path: str | None = None
        self._env = dict(os.environ, **(env or {}))
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ManagedServer":
        try:
            self.start()
        except BaseException:  # a start cut short (a signal, Ctrl-C, a timeout) must not leave the server
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path = new_log(self.log_dir, self.log_label)
        self._healthy = False
        log = open(self.log_path, "w")
        try:
            # Its own process group, so that we stop all it spawns, but our session: Linux's autogroup
            # shares the CPU between sessions by their recent load, so a server in a session of its own
            # starves our mostly idle load generator whenever the cores are busy: its requests go out
            # late, and the clients time that wait into every TTFT. Stdin from /dev/null: a read of the
            # terminal from a process group that is not the terminal's foreground one stops it (SIGTTIN).
            spawn(self.command, self._keep, stdout=log, stderr=subprocess.STDOUT, env=self._env,
                  stdin=subprocess.DEVNULL, process_group=0)
        except OSError as err:
            message = f"cannot run {self.command[0]!r}: {err.strerror or err}"
            raise TargetStartError(message, cause=message) from err
        finally:
            log.close()
        self._wait_healthy()

    def _keep(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._kill_leftovers()
                raise self.start_error(f"the server exited with status {self.proc.returncode} before it "
                                       "was healthy")
            try:
                if http_get(self.url + "/health", timeout=2).status_code == 200:
                    self._healthy = True
                    return
            except HTTP_ERRORS:
                pass
            time.sleep(0.2)
        self.stop()
        raise self.start_error(f"the server was not healthy at {self.url}/health after "
                               f"{self.start_timeout_s:.0f} s")

    def start_error(self, what: str) -> TargetStartError:
        return start_error(what, self.log_path)

    def _kill_leftovers(self) -> None:
        """The server's leader exited: end what it spawned (vLLM's EngineCore, its workers) too."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and not self.alive:
            raise TargetRunError(f"the server died during the run (exit status {self.proc.returncode}); "
                                 f"last log lines:\n{self.log_tail()}\nfull log: {self.log_path}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is not None:  # the leader died on its own: what it spawned may live on
            self._kill_leftovers()
            return
        try:
            self._term_then_kill(proc, timeout_s)
        except BaseException:  # a signal while waiting: the server must not outlive kvtune
            self._kill_leftovers()
            raise
        if self._own_log_dir and self._healthy:  # a clean stop: nothing will name this log
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def _term_then_kill(self, proc: subprocess.Popen, timeout_s: float) -> None:
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                self._kill_leftovers()  # a child that ignored SIGTERM outlives its leader
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)
