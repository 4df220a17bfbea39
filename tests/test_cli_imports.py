"""What each command loads: `kvtune --help` nothing heavy, a command's parser only its own modules,
and no module of kvtune or kvengine anything outside the declared (non-dev) dependencies."""
import json
import subprocess
import sys
import textwrap

import pytest

from kvtune.cli.commands import COMMANDS

HEAVY = ("torch", "numpy", "sqlalchemy", "optuna", "scipy", "matplotlib", "streamlit", "pandas",
         "httpx", "requests", "locust", "starlette", "kvtune.store", "kvtune.targets.servers")
DEV_ONLY = ("pytest", "hypothesis", "transformers", "openai", "ruff", "selenium")


def loaded_after(code: str) -> list[str]:
    """The top-level modules (and kvtune's) a fresh interpreter holds after running `code`."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        import json, sys
        print(json.dumps(sorted(sys.modules)))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def help_of(*argv: str) -> str:
    return f"""
        from kvtune.cli import main
        try:
            main({list(argv)!r})
        except SystemExit:
            pass
    """


def heavy_in(modules: list[str]) -> list[str]:
    return [h for h in HEAVY if h in modules]


def test_kvtune_help_loads_no_command():
    modules = loaded_after(help_of("--help"))
    assert heavy_in(modules) == []
    assert not [m for m in modules if m.startswith("kvtune.cli.") and m not in
                ("kvtune.cli.commands",)]


@pytest.mark.parametrize("command", ["trace", "plan", "report", "ui"])
def test_a_light_commands_help_loads_no_search_engine_or_store(command):
    modules = loaded_after(help_of(command, "--help"))
    assert f"kvtune.cli.{COMMANDS[command].module}" in modules
    assert not [m for m in ("torch", "optuna", "sqlalchemy", "matplotlib", "streamlit", "scipy") if m in modules]
    others = [f"kvtune.cli.{c.module}" for name, c in COMMANDS.items() if name != command]
    assert not [m for m in others if m in modules]


def test_no_module_imports_a_dev_only_dependency():
    modules = loaded_after("""
        import importlib, pkgutil
        import kvtune, kvengine
        SKIP = ("kvtune.locustfile", "kvtune.ui.")  # locust patches the process; the UI pages are scripts
        for package in (kvtune, kvengine):
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                if not info.name.startswith(SKIP) and not info.name.endswith("__main__"):
                    importlib.import_module(info.name)
    """)
    assert "kvtune.calibrate.runner" in modules and "kvengine.entrypoints.server" in modules  # it did import them all
    assert [m for m in DEV_ONLY if m in modules] == []


def test_the_engine_core_process_loads_no_http_frontend():
    """What a spawned engine core of `python -m kvengine serve` imports before it builds the engine:
    the main module again (as __mp_main__), then build_engine's module."""
    modules = loaded_after("""
        import runpy
        runpy.run_module("kvengine.__main__", run_name="__mp_main__")
        import kvengine.entrypoints.build
    """)
    assert [m for m in ("fastapi", "pydantic", "starlette", "uvicorn", "kvengine.entrypoints.server",
                        "kvengine.entrypoints.protocol") if m in modules] == []
