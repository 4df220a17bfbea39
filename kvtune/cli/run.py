"""`kvtune run`: replay a workload on a target with one config, store it, summarise it."""
from __future__ import annotations

import functools
import json
import sys

from kvengine.config import device_preset, model_preset
from kvengine.entrypoints.flags import add_engine_flags, config_from_args, parse_size

from .commands import COMMANDS
from .args import add_db_argument
from ..calibrate import get_profile
from ..diagnose import Thresholds
from ..diagnose.trial import Simulator, diagnosed, simulator_for
from ..report.fmt import on_gpus
from ..results import RunResult, config_dict
from ..store import Store, resolve_db_url
from ..targets import SimTarget, TargetRunError, TargetStartError, UrlTarget
from .target import add_server_flags, live_target, refuse_unservable, simulated_model, simulated_model_device
from .ray import add_ray_argument, on_ray, refuse_target
from ..stopping import failure_reason
from ..workload import FORMATS, head, rate_scale, read_workload
from .args import add_max_concurrency, name_or_url, positive_float, positive_int

TARGETS = ("sim", "engine", "vllm", "sglang")


def add_run_command(sub) -> None:
    p = sub.add_parser("run", help=COMMANDS["run"].help,
                       description="Replay a workload on a target with one engine config, store the run "
                                   "and print its summary: client-side and server-side figures side by side.")
    p.add_argument("--target", type=name_or_url(TARGETS), default="sim", metavar="TARGET",
                   help="sim (engine core, virtual time), engine (kvengine serve), vllm (vllm serve), "
                        "sglang, or the URL of a running server (observe only) (default: %(default)s)")
    p.add_argument("--workload", required=True, metavar="FILE", help="the trace to replay")
    p.add_argument("--format", choices=FORMATS, help="trace format (default: detected from the content)")
    p.add_argument("--skip-bad", action="store_true", help="skip bad trace records, and say how many")
    p.add_argument("--rate-scale", type=positive_float, default=1.0, metavar="X",
                   help="replay at X times the trace's request rate (default: 1)")
    p.add_argument("--head", type=positive_int, metavar="N", help="only the first N requests")
    add_max_concurrency(p)
    g = p.add_argument_group("model and device")
    g.add_argument("--hf-config", dest="preset", metavar="PATH",
                   help="the model of a Hugging Face config.json (or its folder), instead of a --preset")
    g.add_argument("--preset", metavar="MODEL", help="model preset (default: llama-3-8b; tiny for the "
                                                     "engine target's torch executor)")
    g.add_argument("--device", metavar="DEVICE", help="device preset for sim, or cpu/cuda/a preset for the "
                                                      "engine target (default: h100-80gb; cpu for torch)")
    g.add_argument("--profile", metavar="NAME",
                   help="sim target: a calibrated cost profile (kvtune calibrate --name NAME); its model and "
                        "device replace the presets")
    g.add_argument("--executor", choices=("torch", "sim"), default="torch",
                   help="the engine target's executor (default: %(default)s)")
    g.add_argument("--device-memory", type=parse_size, metavar="SIZE",
                   help="engine target on the CPU: the memory budget (e.g. 2GiB)")
    add_engine_flags(p, platform_block_size=True)
    add_server_flags(p)
    add_ray_argument(p, "start the run's server and its load generator in a Ray task on a slot of a cluster "
                        "(the GPUs of --tensor-parallel-size on the node Ray picks), never on this machine; "
                        "the stored run keeps its slot")
    add_db_argument(p)
    p.add_argument("--out", metavar="FILE", help="also write the whole run (requests, series, summary) as JSON")
    p.add_argument("--json", action="store_true", help="end with the summary as one JSON object")
    p.set_defaults(func=cmd_run)


def build_target(args):
    """The target the flags name, and the (model, device) labels it runs."""
    if args.target in ("sim", "engine"):  # what it simulates, or serves
        preset, device = simulated_model_device(args)
    else:  # vLLM and SGLang serve their --model, on their own device
        preset, device = simulated_model(args, None), args.device
    if args.target == "sim":
        if args.profile:
            profile = get_profile(args.db, args.profile)
            return profile.sim_target(), profile.model, profile.device
        return SimTarget(model_preset(preset), device_preset(device)), preset, device
    if args.target == "engine" and args.executor == "sim":
        device_preset(device)  # the sim executor needs a device preset: fail early if unknown
    target = live_target(args.target, args, preset, device)
    label = {"engine": args.model or preset, "vllm": args.model, "sglang": args.model}.get(args.target)
    return target, label, device or target.options.device


def cmd_run(args) -> int:
    refuse_target(args)  # --ray with a URL or sim: before the trace is read or the URL asked anything
    config = config_from_args(args)
    db_url = resolve_db_url(args.db)
    workload = _workload(args)  # a bad trace or flag fails before anything is created
    target, model_label, device = build_target(args)
    if args.target == "sim":
        if args.profile:  # the calibrated server's block size, batch limits and pool, where no flag sets them
            config = get_profile(args.db, args.profile).server_defaults(config)
        config.resolve(target.model, target.device)  # bad flags fail before any work
    else:
        config.validate()
        refuse_unservable(target, config)  # what the server's rules refuse: before it starts or is stored
    if not args.ray:
        return _stored_run(args, target, config, workload, db_url, model_label, device)
    ray_target, pool = on_ray(args, target, config.tensor_parallel_size or 1)  # before the store is made
    try:
        print(f"the run's server starts in a Ray task on a slot of {pool.slot_text} of Ray cluster {args.ray}",
              flush=True)
        return _stored_run(args, ray_target, config, workload, db_url, model_label, device)
    finally:
        pool.close()  # a --ray local cluster ends here


def _stored_run(args, target, config, workload, db_url: str, model_label, device) -> int:
    """Run `config` on `target`, store the run and its diagnoses, print its summary."""
    store = Store(db_url)
    url_target = isinstance(target, UrlTarget)
    run_id = store.start_run(target.name, model_label or args.target, device or "unknown",
                             config=None if url_target else config_dict(config))
    if args.target != "sim" and not args.ray:  # a live run: its scrapes reach the UI while it runs (a Ray
        # task's node may not reach this store: its scrapes are stored with the run as it ends)
        target.options.on_samples = functools.partial(store.add_samples, run_id)
    try:
        result = target.run(None if url_target else config, workload)
        store.save_run(result, run_id=run_id)
    except (TargetStartError, TargetRunError) as err:
        store.mark_run(run_id, "failed", str(err))
        kind = "cannot start" if isinstance(err, TargetStartError) else "run failed"
        print(f"error: {target.name}: {kind}: {err}", file=sys.stderr)
        print(f"failed run {run_id} recorded in {store.display_url}", file=sys.stderr)
        return 1
    except BaseException as err:  # a signal, Ctrl-C, a bug: the run row must not stay 'running'
        store.mark_run(run_id, "failed", failure_reason(err))
        raise
    if args.out:
        result.write_json(args.out)
    found = _diagnose(result, target, workload, args.profile)
    store.save_diagnoses(run_id, found)
    print(format_summary(result))
    if "slot" in result.summary:
        print(f"ran on Ray cluster {args.ray}: {_slot_label(result.summary['slot'])}")
    print(f"run {run_id} stored in {store.display_url}" + (f", written to {args.out}" if args.out else ""))
    print(_findings_line(found, run_id))
    if args.json:
        print(json.dumps(result.summary | {"run_id": run_id, "faults": [d.id for d in found]}))
    return 0


def _slot_label(slot: dict) -> str:
    from ..cluster.slots import Slot

    return Slot.of(slot).label


def _diagnose(result: RunResult, target, workload, profile: str | None) -> list:
    """The run's diagnoses, once, with each fix tried on the simulator (the run's own, for a sim run)."""
    if isinstance(target, SimTarget):  # the run itself is the simulator's baseline
        sim, why = Simulator.of(target, workload, profile).knows(result), ""
    else:
        sim, why = simulator_for(result, workload)
    return diagnosed(result, Thresholds(), sim, why_none=why)


def _findings_line(found: list, run_id: int) -> str:
    if not found:
        return "diagnosis: no faults found (rules F1–F8)"
    listed = ", ".join(f"{d.id} {d.severity}" for d in found)
    return (f"diagnosis: {len(found)} finding{'s' * (len(found) != 1)} ({listed}); `kvtune diagnose --run "
            f"{run_id}` shows the evidence and the fixes tried")


def _workload(args):
    workload = read_workload(args.workload, format=args.format, skip_bad=args.skip_bad)
    if args.skip_bad and workload.skipped:
        print(f"warning: {args.workload}: skipped {workload.skipped} bad records", file=sys.stderr)
    if args.rate_scale != 1.0:
        workload = rate_scale(workload, args.rate_scale)
    if args.head:
        workload = head(workload, args.head)
    return workload.closed_loop(args.max_concurrency)


def format_summary(result: RunResult) -> str:
    from ..results import bound_text, quantile_bound
    s = result.summary

    def ms(key):  # a server quantile in the first or the +Inf bucket is only a bound: "< 300 ms"
        value, bound = s.get(key), quantile_bound(s, key)
        if bound is not None:
            return f"{bound_text(*bound):>9}"
        return f"{'-':>9}" if value is None else f"{value * 1000:9.1f}"

    def pct(value):
        return "-" if value is None else f"{value:.1%}"

    cfg = result.config
    live = "server_ttft_p95" in s
    on = on_gpus(result.device, cfg.get("tensor_parallel_size"))
    lines = [
        f"{result.target}: {result.model} on {on}, " + ", ".join(
            f"{k} {cfg[k]}" for k in ("block_size", "gpu_memory_utilization", "max_num_seqs",
                                      "max_num_batched_tokens", "kv_cache_dtype") if cfg.get(k) is not None),
        f"requests        {s['requests']:,} ({s['completed']:,} completed, {s['rejected']:,} rejected, "
        f"{s['failed']:,} failed) over {s['duration_s']:.1f} s",
        f"throughput      {s['throughput_rps']:.2f} req/s, {s['output_tok_s']:,.0f} output tok/s, "
        f"{s['input_tok_s']:,.0f} input tok/s",
        "latency (ms)         p50       p95       p99" + ("    server p50 p95 p99 (histograms)" if live else ""),
    ]
    for name in ("ttft", "tpot", "itl", "e2e", "queue"):
        row = f"  {name:<10}{ms(name + '_p50')} {ms(name + '_p95')} {ms(name + '_p99')}"
        if live:
            row += f"  {ms('server_' + name + '_p50')} {ms('server_' + name + '_p95')} {ms('server_' + name + '_p99')}"
        lines.append(row)
    lines += [
        f"prefix hits     {pct(s['prefix_hit_rate'])} observed, {pct(s['ideal_prefix_hit_rate'])} ideal "
        "(unbounded cache)" + ("" if s.get("server_cached_prompt_tokens") is None else
                               f"; {s['server_cached_prompt_tokens']:,.0f} prompt tokens served from cache (server)"),
        f"preemptions     {s['preemptions']:,}" + _server_preempted(s),
        f"KV usage        peak {pct(s['kv_usage_peak'])}, mean {pct(s['kv_usage_mean'])}; "
        f"peak running {'-' if s['running_peak'] is None else int(s['running_peak'])}",
    ]
    if result.wall_s:
        lines.append(f"replayed in     {result.wall_s:.1f} s wall")
    if live and not s.get("load_kept_up", True):
        lines.append(f"warning: the load generator fell behind the trace (up to {s['max_lateness_s']:.1f} s "
                     "late): raise --users or --workers, or the run measures a closed loop")
    lines += [f"warning: {note}" for note in s.get("disagreements", [])]
    return "\n".join(lines)


def _server_preempted(s: dict) -> str:
    """'; 24 of 40 requests preempted at least once, 1.2 times each on average (server)'."""
    fewest, finished = s.get("server_requests_preempted"), s.get("server_request_preemptions_count")
    if fewest is None or not finished:
        return ""
    most = s.get("server_requests_preempted_max", fewest)
    count = f"{fewest:,}" if most == fewest else f"{fewest:,}-{most:,}"
    mean = s.get("server_preemptions_per_request")
    return (f"; {count} of {finished:,.0f} requests preempted at least once"
            + ("" if mean is None else f", {mean:.2f} per request") + " (server)")
