"""A throwaway PostgreSQL server on 127.0.0.1 for tests (Debian's server binaries).

    with postgres_server() as base_url:          # postgresql://postgres@127.0.0.1:PORT
        url = fresh_database(base_url, "t_mine")  # postgresql://postgres@127.0.0.1:PORT/t_mine

Raises PostgresUnavailable, with the reason, where no server can be started
(no binaries, no psycopg, running as root without a `postgres` user to run
initdb as, initdb or pg_ctl failing); tests turn that into a skip. The
cluster lives in a temporary folder, trusts local connections, skips fsync,
and is stopped and removed on exit.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator

INSTALL_HINT = "apt-get install -y --no-install-recommends postgresql (Debian/Ubuntu)"


class PostgresUnavailable(RuntimeError):
    """No throwaway PostgreSQL can be started here; the message says why."""


def pg_bindir() -> str | None:
    """The folder with initdb and pg_ctl: the newest /usr/lib/postgresql/*/bin, else PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                   key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0)
    path = found[-1] if found else shutil.which("pg_ctl")
    if path and os.path.exists(os.path.join(os.path.dirname(path), "initdb")):
        return os.path.dirname(path)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as_prefix() -> list[str]:
    """initdb refuses to run as root: run the server as the `postgres` user then."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser") is None or subprocess.run(["id", "postgres"], capture_output=True,
                                                         check=False).returncode:
        raise PostgresUnavailable("running as root without runuser and a 'postgres' user to run initdb as")
    return ["runuser", "-u", "postgres", "--"]


@contextlib.contextmanager
def postgres_server(max_connections: int = 100) -> Iterator[str]:
    """Start a cluster; yield its base URL (no database name: append /postgres or a fresh one)."""
    try:
        import psycopg  # noqa: F401  (the driver SQLAlchemy 2.1 uses for postgresql://)
    except ImportError:
        raise PostgresUnavailable("psycopg (the postgresql:// driver) is not installed") from None
    bindir = pg_bindir()
    if bindir is None:
        raise PostgresUnavailable(f"PostgreSQL server binaries (initdb, pg_ctl) are not installed: {INSTALL_HINT}")
    prefix = _run_as_prefix()
    home = tempfile.mkdtemp(prefix="kvtune-pg-")
    if prefix:
        shutil.chown(home, "postgres")
    data, port = os.path.join(home, "data"), _free_port()

    def pg(*args):
        return subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=60, check=False)

    started = False
    try:
        made = pg(f"{bindir}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        if made.returncode:
            raise PostgresUnavailable(f"initdb failed: {made.stderr.strip()[-300:]}")
        # -F: no fsync; -k: the socket in our folder, not /var/run/postgresql (may not exist).
        run = pg(f"{bindir}/pg_ctl", "-D", data, "-l", os.path.join(home, "log"), "-w", "-t", "30",
                 "-o", f"-p {port} -h 127.0.0.1 -k {home} -F -c max_connections={max_connections}", "start")
        if run.returncode:
            log = ""
            with contextlib.suppress(OSError), open(os.path.join(home, "log")) as f:
                log = f.read()[-300:]
            raise PostgresUnavailable(f"pg_ctl start failed: {(run.stderr.strip() or log)[-300:]}")
        started = True
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        if started:
            pg(f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(home, ignore_errors=True)


def fresh_database(server_url: str, name: str) -> str:
    """(Re)create database `name` on the server; return its URL."""
    import psycopg

    with psycopg.connect(f"{server_url}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{server_url}/{name}"
