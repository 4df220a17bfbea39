"""`python -m kvengine`: the command line of kvengine/entrypoints/cli.py.

Nothing else is imported here: the engine core process, spawned, runs this module again (as
__mp_main__), and should load only the engine it runs (kvengine/entrypoints/build.py), not the
command line's or the HTTP frontend's imports."""
import sys

if __name__ == "__main__":
    from kvengine.entrypoints.cli import main

    sys.exit(main())
