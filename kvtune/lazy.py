"""Package faces that import a name's module on first use (PEP 562).

A face that imported all its modules up front made every command pay for the
heaviest one (`kvtune --help` imported optuna, sqlalchemy, scipy and matplotlib);
now `from kvtune.search import score` loads the modules `score` needs, no more.
"""
from __future__ import annotations

import importlib
import sys


def lazy_face(package: str, exports: dict[str, str]):
    """The `__getattr__` and `__dir__` of `package`, whose name N lives in submodule exports[N]."""
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


def exports_of(modules: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """{".module": (names...)} -> {name: ".module"}."""
    return {name: module for module, names in modules.items() for name in names}
