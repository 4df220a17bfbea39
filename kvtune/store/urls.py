"""Database URLs: the `--db` flag, $KVTUNE_DB or the default, checked before anything opens them."""
from __future__ import annotations

import os
import re

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from ..dburl import DB_ENV, DEFAULT_DB_URL
from .errors import StoreError


def resolve_db_url(cli_value: str | None = None) -> str:
    """The `--db` flag, else $KVTUNE_DB, else `sqlite:///kvtune.db`; checked, relative sqlite paths made absolute.

    Absolute, so that worker processes started elsewhere (and Optuna) open the same file.
    """
    raw = cli_value or os.environ.get(DB_ENV) or DEFAULT_DB_URL
    url = parse_url(raw)
    if is_sqlite_file(url) and not os.path.isabs(url.database):
        url = url.set(database=os.path.abspath(url.database))
    return url.render_as_string(hide_password=False)


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def parse_url(raw: str) -> URL:
    try:
        url = make_url(raw)
    except (ArgumentError, ValueError):
        hint = f" (did you mean sqlite:///{raw}?)" if "://" not in raw else ""
        raise StoreError(f"not a database URL: {mask_url(raw)!r}{hint}") from None
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        raise StoreError(f"unknown database driver {url.drivername!r} in {mask_url(raw)!r}; "
                         "use sqlite:///FILE or postgresql://USER:PASS@HOST:PORT/DB") from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        hint = ""
        if url.get_backend_name() == "postgresql":
            hint = ' (plain postgresql:// uses psycopg 3: pip install "psycopg[binary]")'
        raise StoreError(f"database driver for {mask_url(raw)!r} is not installed: {err}{hint}") from None
    return url


def is_sqlite_file(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") \
        and not url.database.startswith("file:")


def missing_database(db_url: str) -> str | None:
    """The path of a SQLite file `db_url` names that does not exist (opening it would create
    an empty database, which a command that only reads must not), else None."""
    url = make_url(db_url)
    return url.database if is_sqlite_file(url) and not os.path.exists(url.database) else None
