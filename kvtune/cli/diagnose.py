"""`kvtune diagnose --run ID` (a stored run; the diagnoses are stored back) or `--url URL` (watch a server)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from .commands import COMMANDS
from .args import add_db_argument
from ..results import RunResult, engine_config
from ..calibrate.profile import get_profile
from ..workload import FORMATS, read_workload, workload_stats
from ..store import Store, StoreError, resolve_db_url
from ..diagnose.facts import gather
from ..diagnose.model import Diagnosis, Thresholds
from ..diagnose.render import format_diagnoses, pool_overview, run_title
from ..diagnose.signals import Series
from ..diagnose.trial import Simulator, diagnosed, simulator_for
from ..targets.watch import WatchError, history, result_from_scrape, watch


def add_diagnose_command(subparsers) -> None:
    p = subparsers.add_parser(
        "diagnose", help=COMMANDS["diagnose"].help,
        description="Run the fault rules (F1–F8 of the fault card) over a stored run, or over a live "
                    "server's /metrics watched for a while, and print each fault with its evidence and fix. "
                    "Exits 0 whether or not faults are found, 2 on bad input.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=int, metavar="ID", help="a stored run (see `kvtune run`)")
    source.add_argument("--url", type=_server_url, metavar="URL",
                        help="a running vLLM-compatible server to watch (http://host:port)")
    p.add_argument("--duration", type=_positive, default=60.0, metavar="S",
                   help="--url: seconds to watch; with --prometheus, the last S seconds of the server's history "
                        "(default: %(default)s)")
    p.add_argument("--interval", type=_positive, default=1.0, metavar="S",
                   help="--url: seconds between scrapes; with --prometheus, the step of the range read "
                        "(default: %(default)s)")
    p.add_argument("--prometheus", type=_server_url, metavar="URL",
                   help="--url: read the server's series from this Prometheus server instead of watching it "
                        "(e.g. the last hour of a production server: --duration 3600 --interval 15)")
    p.add_argument("--selector", metavar="MATCHER",
                   help='--prometheus: the label matcher of the server\'s series there, e.g. \'{job="vllm"}\' '
                        '(default: {instance="HOST:PORT"} of --url)')
    p.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE",
                   help="override a rule threshold, e.g. ttft_p95_slo_s=0.5 (repeatable; names: "
                        + ", ".join(Thresholds.names()) + ")")
    p.add_argument("--workload", metavar="FILE",
                   help="--run: the trace the run replayed, for the simulator to try each fix on (default: the "
                        "run's own trace file, if it is still there as it was)")
    p.add_argument("--format", choices=FORMATS, help="--workload's format (default: detected from the content)")
    p.add_argument("--profile", metavar="NAME",
                   help="--run: the calibrated simulator (`kvtune calibrate --name NAME`) that tries the fixes "
                        "(default: the run's model and device presets, where it names presets)")
    add_db_argument(p)
    p.add_argument("--json", action="store_true", help="end with one JSON object with a 'diagnoses' list")
    p.set_defaults(func=cmd_diagnose)


def _server_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected a server URL such as http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def parse_thresholds(pairs: list[str]) -> Thresholds:
    defaults = Thresholds()
    changes = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in Thresholds.names():
            raise ValueError(f"--threshold {pair!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(Thresholds.names())}")
        kind = type(getattr(defaults, name))
        try:
            changes[name] = kind(text)
        except ValueError:
            raise ValueError(f"--threshold {pair!r}: {text!r} is not a{'n' * (kind is int)} {kind.__name__}") \
                from None
    return dataclasses.replace(defaults, **changes)


def cmd_diagnose(args) -> int:
    try:
        if (args.prometheus or args.selector) and args.url is None:
            raise ValueError("--prometheus and --selector read a server's history: give its --url too")
        if args.selector and not args.prometheus:
            raise ValueError("--selector picks series in Prometheus: give --prometheus URL too")
        thresholds = parse_thresholds(args.threshold)
        if args.run is not None:
            return _diagnose_stored(args, thresholds)
        return _diagnose_live(args, thresholds)
    except (ValueError, StoreError, WatchError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _diagnose_stored(args, thresholds: Thresholds) -> int:
    from ..search.slo import diagnosis_thresholds  # the search's modules import this package's
    from ..search.study import study_slos

    db_url = resolve_db_url(args.db)
    store = Store(db_url)
    row = store.get_run(args.run)
    result = store.load_run(args.run)
    error = (row.error or "(no error recorded)") if row.status == "failed" else None
    # A study's run is judged by the study's SLOs, as its search judged it when it stored these.
    slos = study_slos(db_url, row.study) if row.study else []
    if not any(t.startswith("ttft_p95_slo_s=") for t in args.threshold):
        thresholds = diagnosis_thresholds(slos, thresholds)
    simulator, why_none = _simulator(args, result)
    diagnoses = diagnosed(result, thresholds, simulator, slos, error=error, why_none=why_none)
    store.save_diagnoses(args.run, diagnoses)
    label = f"run {args.run}" + (" (failed)" if error is not None else "")
    if slos:
        label += f" of study {row.study!r}, judged by its SLOs ({', '.join(map(str, slos))})"
    _print(result, label, diagnoses, thresholds, args.json, {"run_id": args.run},
           f"diagnoses stored with run {args.run} in {store.display_url}")
    return 0


def _diagnose_live(args, thresholds: Thresholds) -> int:
    if args.prometheus:
        result = result_from_scrape(history(args.prometheus, args.url, args.duration, args.interval, args.selector),
                                    args.url)
        label = f"{args.url} over its last {args.duration:g} s in Prometheus at {args.prometheus}"
    else:
        print(f"watching {args.url} for {args.duration:g} s ...", file=sys.stderr)
        result, label = watch(args.url, args.duration, args.interval), args.url
    diagnoses = diagnosed(result, thresholds, None,
                          why_none="a watched server gives no requests to replay (`kvtune run` then "
                                   "`kvtune diagnose --run ID` tries each fix in the simulator)")
    # Stored as a run of the watch target, so the UI's runs page and `diagnose --run` find it again.
    store = Store(resolve_db_url(args.db))
    run_id = store.save_run(result, label=f"watch of {args.url}")
    store.save_diagnoses(run_id, diagnoses)
    _print(result, label, diagnoses, thresholds, args.json, {"url": args.url, "prometheus": args.prometheus,
                                                             "run_id": run_id},
           f"the watch and its diagnoses stored as run {run_id} in {store.display_url}")
    return 0


def _simulator(args, result: RunResult) -> tuple[Simulator | None, str]:
    """The simulator that tries the fixes on the run's own trace, or why there is none."""
    workload, why = _replayed_workload(args.workload, args.format, result)
    if workload is None:
        return None, why
    if args.profile:
        return Simulator.of(get_profile(args.db, args.profile).sim_target(), workload, args.profile), ""
    return simulator_for(result, workload)


def _replayed_workload(path: str | None, fmt: str | None, result: RunResult):
    """The trace the run replayed, checked against the profile stored with the run."""
    path = path or result.workload.get("source")
    if not path or not os.path.isfile(path):
        return None, "the run's trace is not at hand: pass --workload FILE to try the fixes in the simulator"
    workload = read_workload(path, format=fmt)
    stored = result.workload
    mine = workload_stats(workload, block_size=engine_config(stored).block_size)
    differ = [k for k in ("requests", "prompt_tokens", "output_tokens") if stored.get(k) not in (None, mine[k])]
    if stored.get("duration_s") and not math.isclose(stored["duration_s"], mine["duration_s"], rel_tol=0.01):
        differ.append("duration_s")
    if differ:
        return None, (f"{path} is not the trace this run replayed ({', '.join(differ)} differ; a --head or "
                      "--rate-scale?): pass --workload with the trace as replayed to try the fixes")
    return workload, ""


def _print(result: RunResult, label: str, diagnoses: list[Diagnosis], thresholds: Thresholds, as_json: bool,
           extra: dict, footer: str | None) -> None:
    overview = pool_overview(gather(result, thresholds)) if len(Series(result.series)) else []
    print(run_title(result, label))
    for line in overview:
        print("  " + line)
    print()
    print(format_diagnoses(diagnoses))
    if footer:
        print(footer)
    if as_json:
        print(json.dumps(extra | {"diagnoses": [d.to_dict() for d in diagnoses], "overview": overview}))
