"""`kvtune ui [--db URL] [--port N]`: the Streamlit app on 127.0.0.1, reading the run store.

The process becomes `python -m streamlit run kvtune/ui/app.py` (exec), so
stopping it stops the server. The database URL goes to the app as $KVTUNE_DB,
not on the command line, where ps would show a password.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from .commands import COMMANDS
from .args import add_db_argument
from ..dburl import DB_ENV

APP = Path(__file__).resolve().parent.parent / "ui" / "app.py"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8501


def add_ui_command(subparsers) -> None:
    p = subparsers.add_parser(
        "ui", help=COMMANDS["ui"].help,
        description="Start the Streamlit app on 127.0.0.1 and print its address. It reads the database "
                    "only; it never starts engines or searches (the Live page scrapes the URL you give it).")
    add_arguments(p)
    p.set_defaults(func=cmd_ui)


def add_arguments(parser) -> None:
    add_db_argument(parser)
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="address to bind (default: %(default)s; 0.0.0.0 inside a container)")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="(default: %(default)s)")


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {text!r}")
    return port


def streamlit_command(port: int, python: str = sys.executable, host: str = DEFAULT_HOST) -> list[str]:
    return [python, "-m", "streamlit", "run", str(APP), "--server.address", host, "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--client.toolbarMode", "viewer"]


def port_free(port: int, host: str = DEFAULT_HOST) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def cmd_ui(args) -> int:
    from ..store import mask_url, resolve_db_url

    db_url = resolve_db_url(args.db)
    if not port_free(args.port, args.host):
        print(f"error: port {args.port} on {args.host} is in use: pass --port N", file=sys.stderr)
        return 2
    print(f"kvtune ui: http://{args.host}:{args.port} (database {mask_url(db_url)})", flush=True)
    env = dict(os.environ, **{DB_ENV: db_url})
    env.setdefault("OMP_NUM_THREADS", "1")
    command = streamlit_command(args.port, host=args.host)
    os.execve(command[0], command, env)
    return 0  # not reached


def main(argv=None) -> int:
    """`python -m kvtune.cli.ui`: the same command on its own."""
    parser = argparse.ArgumentParser(prog="kvtune ui", description="Start the kvtune web UI.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    from ..store import StoreError

    try:
        return cmd_ui(args)
    except StoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
