#!/usr/bin/env python3
"""Differential testing: kvengine's Scheduler + KVCacheManager against vLLM's real V1
Scheduler, step by step, on random step traces.

    python benchmarks/vllm_differential.py --seeds 2000 --json
    python benchmarks/vllm_differential.py --seeds 500 --hybrid --json   # full + sliding-window groups
    python benchmarks/vllm_differential.py --seeds 50 --start 1000 --save-dir /tmp/div

Each seed makes one trace (random_trace); both sides run it one token per step with
no model (kvengine here, vLLM in benchmarks/vllm_step_driver.py under --vllm-python)
and every step is compared: the tokens scheduled per request, the preempted ids, the
finished ids, the prefix-hit tokens of each admitted request. A divergent trace is
shrunk (delta debugging over requests and aborts, then prompt lengths, output
lengths, arrival steps and the config) and both sides' first differing step printed.
The last line (--json) is {"traces", "divergent", "first_divergence", "errors",
"schedule_cost"}: schedule()'s p50 at >= 250 running requests, kvengine/vLLM.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvengine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvengine.core.kv_cache_manager import KVCacheManager
from kvengine.core.memory import KVGroups
from kvengine.config import EngineConfig
from kvengine.core.request import Request, SamplingParams
from kvengine.core.scheduler import Scheduler

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "benchmarks" / "vllm_step_driver.py"
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MAX_STEPS = 20000
FAKE_TOKEN = 7  # what both sides sample; ignore_eos
PREFIX_KEYS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries",
               "preempted_hits")


# -- random traces -------------------------------------------------------------
def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 31000) for _ in range(n)]


def _segment_len(rng: random.Random, bs: int, max_blocks: int) -> int:
    """A length ending on a block boundary, one short of it, one past it, or anywhere."""
    blocks = rng.randint(0, max_blocks)
    return max(1, blocks * bs + rng.choice((0, 0, -1, 1, rng.randrange(bs))))


def _prefix_tree(rng: random.Random, bs: int, room: int) -> list[list[int]]:
    """Shared prefixes at several depths: every node's tokens extend its parent's."""
    nodes: list[list[int]] = []
    for _ in range(rng.randint(1, 3)):
        frontier = [_tokens(rng, min(room, _segment_len(rng, bs, 8)))]
        while frontier:
            node = frontier.pop()
            nodes.append(node)
            if len(nodes) < 12 and rng.random() < 0.6:
                for _ in range(rng.randint(1, 3)):
                    extra = min(room - len(node), _segment_len(rng, bs, 4))
                    if extra > 0:
                        frontier.append(node + _tokens(rng, extra))
    return nodes


def _arrivals(rng: random.Random, n: int) -> list[int]:
    mode = rng.choice(("zero", "spread", "bursts", "mixed"))
    if mode == "zero":
        return [0] * n
    if mode == "spread":
        gap = rng.choice((1, 2, 5))
        return sorted(rng.randint(0, gap * n) for _ in range(n))
    if mode == "bursts":
        starts = sorted(rng.randint(0, 60) for _ in range(rng.randint(1, 4)))
        return sorted(rng.choice(starts) for _ in range(n))
    steps, t = [], 0
    for _ in range(n):
        t += rng.choice((0, 0, 0, 1, 2, 7))
        steps.append(t)
    return steps


def _config(rng: random.Random, bs: int, max_model_len: int) -> dict:
    chunked = rng.random() < 0.75
    max_num_seqs = rng.choice((1, 2, 3, 4, 8, 16, 32, 128, 256))
    budget = rng.choice((4, 8, 16, 32, 48, 64, 128, 256, 512, 2048, 8192))
    budget = max(budget, max_num_seqs, 0 if chunked else max_model_len)
    threshold = 0 if rng.random() < 0.6 else min(max_model_len, rng.choice((1, bs - 1, bs, bs + 1, 40, 100)))
    return {"block_size": bs, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": budget, "long_prefill_token_threshold": threshold,
            "enable_chunked_prefill": chunked, "enable_prefix_caching": rng.random() < 0.85}


def _pool_blocks(rng: random.Random, requests: list[dict], bs: int, max_model_len: int) -> int:
    """From tight (one request at its longest just fits: preemption storms) to roomy
    (every block of every request fits; eviction order matters once the pool wraps)."""
    need = [math.ceil(min(len(r["prompt_token_ids"]) + r["max_tokens"], max_model_len) / bs)
            for r in requests]
    least, total = max(need), sum(need)
    factor = rng.choice((1.0, 1.0, 1.2, 1.5, 2.0, 3.0, None))
    blocks = total + rng.randint(0, 20) if factor is None else int(least * factor) + rng.randint(0, 3)
    return max(least, blocks) + 1  # + the null block


def random_trace(seed: int, hybrid: bool = False) -> dict:
    """One random trace; `hybrid`: its pool serves a full-attention group and a sliding-window one."""
    rng = random.Random(seed)
    bs = rng.choice((8, 16, 16))
    max_model_len = rng.choice((128, 256, 512, 1024))
    room = max_model_len - 1  # a prompt must leave room for one output token
    nodes = _prefix_tree(rng, bs, room)
    n = rng.choice((1, 2, 3, 5, 8, 12, 20, 30, 40, 40, 40, 120))
    requests = []
    for i, arrival in enumerate(_arrivals(rng, n)):
        if requests and rng.random() < 0.2:
            # A next turn: an earlier prompt, the answer it got, a new message.
            prev = rng.choice(requests)
            base = prev["prompt_token_ids"] + [FAKE_TOKEN] * rng.randint(0, prev["max_tokens"])
        else:
            base = rng.choice(nodes) if rng.random() < 0.85 else []
        suffix = 0 if rng.random() < 0.2 else _segment_len(rng, bs, 3)
        prompt = (base + _tokens(rng, suffix))[:room] or _tokens(rng, 1)
        max_tokens = rng.choice((1, 2, rng.randint(1, 16), rng.randint(1, 64), rng.randint(50, 300)))
        requests.append({"request_id": f"r{i}", "prompt_token_ids": prompt,
                         "max_tokens": max_tokens, "arrival_step": arrival})
    config = _config(rng, bs, max_model_len)
    config["num_blocks"] = _pool_blocks(rng, requests, bs, max_model_len)
    if hybrid:  # groups draw on the one pool: blocks for each, and a window of a few blocks
        kinds = rng.choice((["full", "sliding"], ["sliding", "full"], ["full", "sliding", "sliding"], ["sliding"]))
        config["num_blocks"] = len(kinds) * config["num_blocks"]
        config["kv_groups"] = {"kinds": kinds,
                               "window": rng.choice((bs // 2, bs, bs + 1, 2 * bs, 3 * bs - 1, 5 * bs))}
    trace = {"name": f"seed-{seed}" + ("-hybrid" if hybrid else ""), "config": config, "requests": requests,
             "aborts": []}
    if rng.random() < 0.35:
        trace["aborts"] = _aborts(rng, trace)
    return trace


def _aborts(rng: random.Random, trace: dict) -> list[dict]:
    """Aborts at steps where kvengine has the request waiting, mid-prefill or mid-decode
    (a step number is what both sides get; the aim is only to land in those states)."""
    states: dict[str, list[tuple[int, str]]] = {}

    def observe(step, sched, out):
        for req in out.scheduled:
            phase = "prefill" if req.num_computed_tokens < req.num_tokens else "decode"
            states.setdefault(req.request_id, []).append((step, phase))
        for req in sched.waiting:
            states.setdefault(req.request_id, []).append((step, "waiting"))

    run_kvengine(trace, observe=observe)
    aborts = []
    for rid in rng.sample(sorted(states), k=min(len(states), rng.randint(1, 4))):
        seen = states[rid]
        for phase in ("prefill", "decode", "waiting"):
            steps = [s for s, p in seen if p == phase]
            if steps and rng.random() < 0.5:
                aborts.append({"step": rng.choice(steps), "request_id": rid})
                break
        else:
            aborts.append({"step": rng.choice(seen)[0] + rng.randint(0, 2), "request_id": rid})
    return sorted(aborts, key=lambda a: a["step"])


# -- kvengine's side -----------------------------------------------------------
def build_kvengine(config: dict) -> Scheduler:
    cfg = EngineConfig(block_size=config["block_size"], max_num_seqs=config["max_num_seqs"],
                       max_num_batched_tokens=config["max_num_batched_tokens"],
                       max_model_len=config["max_model_len"],
                       long_prefill_token_threshold=config.get("long_prefill_token_threshold", 0),
                       enable_chunked_prefill=config.get("enable_chunked_prefill", True),
                       enable_prefix_caching=config.get("enable_prefix_caching", True))
    groups = config.get("kv_groups")
    if groups:  # layer groups of several kinds: vLLM's hybrid coordinator
        kv = HybridKVCacheManager(config["num_blocks"], config["block_size"], config["max_model_len"],
                                  KVGroups(1, tuple(groups["kinds"]), groups.get("window")),
                                  enable_caching=cfg.enable_prefix_caching,
                                  in_flight_tokens=cfg.max_num_batched_tokens)  # one step in flight
    else:
        kv = KVCacheManager(config["num_blocks"], config["block_size"], config["max_model_len"],
                            enable_caching=cfg.enable_prefix_caching)
    return Scheduler(cfg, kv)


def run_kvengine(trace: dict, max_steps: int = MAX_STEPS, observe=None) -> dict:
    """The driver's loop (see vllm_step_driver.py) with kvengine's scheduler; same result."""
    sched = build_kvengine(trace["config"])
    timing = bool(trace.get("timing"))
    pending = sorted(trace["requests"], key=lambda r: r.get("arrival_step", 0))
    aborts: dict[int, list[str]] = {}
    for a in trace.get("aborts", ()):
        aborts.setdefault(int(a["step"]), []).append(str(a["request_id"]))
    steps, schedule_ns, running = [], [], []
    pi = step = 0
    while True:
        while pi < len(pending) and pending[pi].get("arrival_step", 0) <= step:
            item = pending[pi]
            sp = SamplingParams(max_tokens=int(item["max_tokens"]), ignore_eos=True, temperature=0.0)
            sched.add_request(Request(str(item["request_id"]), list(item["prompt_token_ids"]), sp))
            pi += 1
        for rid in aborts.get(step, ()):
            sched.finish_requests([rid])
        if pi >= len(pending) and not sched.has_unfinished():
            break
        if step >= max_steps:
            return {"name": trace.get("name"), "error": f"still running at max_steps={max_steps}"}
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        if timing:
            schedule_ns.append(time.perf_counter_ns() - t0)
            running.append(len(sched.running))
        if observe is not None:
            observe(step, sched, out)
        pairs = list(zip(out.scheduled, out.num_new_tokens))
        admitted = pairs[len(pairs) - out.num_new_reqs:] if out.num_new_reqs else []
        sampled = [FAKE_TOKEN if r.num_computed_tokens >= r.num_tokens else None for r in out.scheduled]
        finished = sched.update_from_output(out, sampled)
        steps.append({"scheduled": [[r.request_id, n] for r, n in pairs],
                      "preempted": sorted(r.request_id for r in out.preempted),
                      "finished": [r.request_id for r in finished],
                      "hits": [[r.request_id, r.num_computed_tokens - n] for r, n in admitted]})
        step += 1
    stats = sched.kv.prefix_stats
    res = {"name": trace.get("name"), "steps": steps,
           "prefix_cache": {k: getattr(stats, k) for k in PREFIX_KEYS}}
    if timing:
        res["schedule_ns"], res["running"] = schedule_ns, running
    return res


# -- vLLM's side ---------------------------------------------------------------
class VllmDriver:
    """One vllm_step_driver.py process held open: a trace in, its result out."""

    def __init__(self, python: str | os.PathLike, max_steps: int = MAX_STEPS):
        self.proc = subprocess.Popen(
            [str(python), str(DRIVER), "--max-steps", str(max_steps)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
            env=dict(os.environ, OMP_NUM_THREADS="1"))

    def submit(self, trace: dict) -> None:
        self.proc.stdin.write(json.dumps(trace, separators=(",", ":")) + "\n")
        self.proc.stdin.flush()

    def collect(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM step driver exited (rc {self.proc.poll()})")
        return json.loads(line)

    def run(self, trace: dict) -> dict:
        self.submit(trace)
        return self.collect()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- comparing -----------------------------------------------------------------
@dataclass
class Divergence:
    step: int  # -1: the totals
    what: str
    kvengine: object
    vllm: object


def first_divergence(ours: dict, theirs: dict) -> Divergence | None:
    for i, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
        for key in ("scheduled", "preempted", "hits", "finished"):
            if a[key] != b[key]:
                return Divergence(i, key, a, b)
    n, m = len(ours["steps"]), len(theirs["steps"])
    if n != m:
        return Divergence(min(n, m), "steps", n, m)
    if ours["prefix_cache"] != theirs["prefix_cache"]:
        return Divergence(-1, "prefix_cache", ours["prefix_cache"], theirs["prefix_cache"])
    return None


def compare(trace: dict, driver: VllmDriver) -> tuple[Divergence | None, str | None]:
    """(the first divergence or None, an error from either side or None)."""
    theirs = driver.run(trace)
    ours = run_kvengine(trace)
    error = theirs.get("error") or ours.get("error")
    if error:
        return None, error
    return first_divergence(ours, theirs), None


# -- shrinking -----------------------------------------------------------------
def ddmin(items: list, fails) -> list:
    """Zeller's delta debugging: a 1-minimal sublist of `items` for which fails() holds."""
    if fails([]):
        return []
    n = 2
    while len(items) >= 2:
        size = math.ceil(len(items) / n)
        parts = [items[i:i + size] for i in range(0, len(items), size)]
        for i, part in enumerate(parts):
            if fails(part):
                items, n = part, 2
                break
            rest = [x for j, p in enumerate(parts) if j != i for x in p]
            if len(parts) > 2 and fails(rest):
                items, n = rest, max(n - 1, 2)
                break
        else:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


def _with(trace: dict, **changes) -> dict:
    out = dict(trace, **changes)
    kept = {r["request_id"] for r in out["requests"]}
    out["aborts"] = [a for a in out["aborts"] if a["request_id"] in kept]
    return out


def _valid(trace: dict) -> bool:
    c, requests = trace["config"], trace["requests"]
    need = max(math.ceil(min(len(r["prompt_token_ids"]) + r["max_tokens"], c["max_model_len"])
                         / c["block_size"]) for r in requests)
    return (c["max_num_batched_tokens"] >= c["max_num_seqs"]
            and (c["enable_chunked_prefill"] or c["max_num_batched_tokens"] >= c["max_model_len"])
            and c["long_prefill_token_threshold"] <= c["max_model_len"]
            and c["num_blocks"] - 1 >= need
            and all(len(r["prompt_token_ids"]) < c["max_model_len"] for r in requests))


def _smaller_ints(value: int, floor: int) -> list[int]:
    return sorted({v for v in (floor, value // 2, value * 3 // 4, value - 1) if floor <= v < value})


def shrink(trace: dict, diverges, log=None) -> dict:
    """The smallest trace found that still diverges (`diverges(trace)` -> Divergence or
    None): requests, aborts, then each request's output, arrival and prompt, then the
    config, until nothing shrinks. The token budget may also grow, where that makes
    the divergence come at an earlier step."""
    if not diverges(trace):
        return trace
    changed = True
    while changed:
        size = (len(trace["requests"]), len(trace["aborts"]))
        trace = _with(trace, requests=ddmin(trace["requests"], lambda rs: bool(rs) and bool(diverges(
            _with(trace, requests=rs)))))
        trace["aborts"] = ddmin(trace["aborts"], lambda ab: bool(diverges(dict(trace, aborts=ab))))
        changed = (len(trace["requests"]), len(trace["aborts"])) != size
        for i in range(len(trace["requests"])):
            for field_, floor in (("max_tokens", 1), ("arrival_step", 0), ("prompt_len", 1)):
                req = trace["requests"][i]
                value = len(req["prompt_token_ids"]) if field_ == "prompt_len" else req[field_]
                for v in _smaller_ints(value, floor):
                    new = dict(req, prompt_token_ids=req["prompt_token_ids"][:v]) if field_ == "prompt_len" \
                        else dict(req, **{field_: v})
                    cand = dict(trace, requests=trace["requests"][:i] + [new] + trace["requests"][i + 1:])
                    if _valid(cand) and diverges(cand):
                        trace, changed = cand, True
                        break
        for key, floor in (("num_blocks", 2), ("max_num_seqs", 1), ("long_prefill_token_threshold", 0),
                           ("max_model_len", 2)):
            for v in _smaller_ints(trace["config"][key], floor):
                cand = dict(trace, config=dict(trace["config"], **{key: v}))
                if _valid(cand) and diverges(cand):
                    trace, changed = cand, True
                    break
        at = diverges(trace).step
        for v in (8192, 2048, 512, 128, 64, 32, 16, 8, 4, 2, 1):
            cand = dict(trace, config=dict(trace["config"], max_num_batched_tokens=v))
            div = _valid(cand) and diverges(cand)
            if div and 0 <= div.step < at:
                trace, at, changed = cand, div.step, True
        if log:
            log(f"  shrunk to {len(trace['requests'])} requests, {len(trace['aborts'])} aborts, "
                f"{sum(len(r['prompt_token_ids']) for r in trace['requests'])} prompt tokens, "
                f"diverging at step {at}")
    return _renamed(trace, diverges)


def _renamed(trace: dict, diverges) -> dict:
    """Request ids r0, r1, ... in arrival order, if the divergence survives it."""
    names = {r["request_id"]: f"r{i}" for i, r in enumerate(
        sorted(trace["requests"], key=lambda r: r["arrival_step"]))}
    cand = dict(trace, requests=[dict(r, request_id=names[r["request_id"]]) for r in trace["requests"]],
                aborts=[dict(a, request_id=names[a["request_id"]]) for a in trace["aborts"]])
    return cand if diverges(cand) else trace


def describe(trace: dict) -> str:
    c = trace["config"]
    lines = [f"config: {json.dumps(c)}"]
    for r in trace["requests"]:
        lines.append(f"  {r['request_id']}: prompt {len(r['prompt_token_ids'])} tokens, "
                     f"max_tokens {r['max_tokens']}, arrives at step {r['arrival_step']}")
    for a in trace["aborts"]:
        lines.append(f"  abort {a['request_id']} at step {a['step']}")
    return "\n".join(lines)


# -- schedule() cost -------------------------------------------------------------
def cost_trace(n: int = 600, seed: int = 0) -> dict:
    """vllm_parity's hot256 shape: requests sharing a 512-token system prompt, room for
    256 running, so most steps schedule >= 250 requests."""
    rng = random.Random(seed)
    prefix = _tokens(rng, 512)
    requests = [{"request_id": f"r{i}", "prompt_token_ids": prefix + _tokens(rng, rng.randint(32, 256)),
                 "max_tokens": rng.randint(128, 256), "arrival_step": 0} for i in range(n)]
    config = {"block_size": 16, "num_blocks": 20000, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
              "max_model_len": 4096, "long_prefill_token_threshold": 0, "enable_chunked_prefill": True,
              "enable_prefix_caching": True}
    return {"name": "cost", "config": config, "requests": requests, "aborts": [], "timing": True}


def _p50_hot(res: dict, min_running: int) -> float:
    xs = sorted(ns for ns, r in zip(res["schedule_ns"], res["running"]) if r >= min_running)
    return xs[len(xs) // 2] / 1000 if xs else float("nan")


def schedule_cost(driver: VllmDriver, min_running: int = 250) -> dict:
    trace = cost_trace()
    theirs, ours = driver.run(trace), run_kvengine(trace)
    k, v = _p50_hot(ours, min_running), _p50_hot(theirs, min_running)
    return {"running_at_least": min_running, "kvengine_us_p50": round(k, 1), "vllm_us_p50": round(v, 1),
            "ratio": round(k / v, 3), "same_decisions": first_divergence(ours, theirs) is None}


# -- CLI -----------------------------------------------------------------------
def run_seeds(seeds: list[int], python: str, jobs: int, log, hybrid: bool = False) -> tuple[list, list]:
    """(divergent [(seed, Divergence)], errors [(seed, str)]): `jobs` drivers, round robin; `hybrid`:
    traces whose pool serves full and sliding-window layer groups."""
    drivers = [VllmDriver(python) for _ in range(jobs)]
    divergent, errors = [], []
    try:
        for start in range(0, len(seeds), jobs):
            batch = [(s, random_trace(s, hybrid)) for s in seeds[start:start + jobs]]
            for d, (_, trace) in zip(drivers, batch):
                d.submit(trace)
            ours = [run_kvengine(trace) for _, trace in batch]
            for d, (seed, _), mine in zip(drivers, batch, ours):
                theirs = d.collect()
                error = theirs.get("error") or mine.get("error")
                if error:
                    errors.append((seed, error.splitlines()[0]))
                    continue
                div = first_divergence(mine, theirs)
                if div:
                    divergent.append((seed, div))
                    log(f"seed {seed}: diverges at step {div.step} ({div.what})")
            if (start // jobs) % 100 == 99:
                log(f"... {start + len(batch)} traces, {len(divergent)} divergent")
    finally:
        for d in drivers:
            d.close()
    return divergent, errors


def report_divergence(seed: int, python: str, save_dir: str | None, log, hybrid: bool = False) -> dict:
    with VllmDriver(python) as driver:
        def diverges(trace):
            div, error = compare(trace, driver)
            return None if error else div
        small = shrink(random_trace(seed, hybrid), diverges, log)
        div, theirs = diverges(small), driver.run(small)
    if div is None:
        log(f"seed {seed} does not diverge")
        return {"seed": seed, "requests": len(small["requests"]), "step": None}
    log(f"seed {seed} shrunk: {len(small['requests'])} requests\n{describe(small)}")
    log(f"first difference at step {div.step}, in {div.what!r}:")
    log(f"  kvengine: {json.dumps(div.kvengine)}\n  vLLM:     {json.dumps(div.vllm)}")
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, f"seed-{seed}.json")
        with open(path, "w") as f:  # what a regression test replays without vLLM
            json.dump({"trace": small, "vllm": {k: theirs[k] for k in ("steps", "prefix_cache")}}, f)
        log(f"  saved {path}")
    return {"seed": seed, "requests": len(small["requests"]), **asdict(div)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=100, help="how many random traces")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    ap.add_argument("--jobs", type=int, default=2, help="vLLM driver processes")
    ap.add_argument("--no-shrink", action="store_true", help="do not shrink the first divergence")
    ap.add_argument("--no-cost", action="store_true", help="skip the schedule() cost measurement")
    ap.add_argument("--save-dir", help="write the shrunk divergent trace here")
    ap.add_argument("--hybrid", action="store_true",
                    help="traces of a model with full and sliding-window layer groups (vLLM's hybrid coordinator)")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args(argv)
    if not Path(args.vllm_python).exists():
        sys.exit(f"error: --vllm-python {args.vllm_python}: no such file (`make vllm` installs it)")

    def log(msg):
        print(msg, flush=True)

    t0 = time.perf_counter()
    seeds = list(range(args.start, args.start + args.seeds))
    divergent, errors = run_seeds(seeds, args.vllm_python, max(1, args.jobs), log, args.hybrid)
    log(f"{len(seeds)} traces, {len(divergent)} divergent, {len(errors)} errors "
        f"in {time.perf_counter() - t0:.0f} s")
    for seed, err in errors[:5]:
        log(f"  seed {seed}: {err}")
    first = None
    if divergent:
        seed, div = divergent[0]
        first = {"seed": seed, **asdict(div)} if args.no_shrink else \
            report_divergence(seed, args.vllm_python, args.save_dir, log, args.hybrid)
    cost = None
    if not args.no_cost:
        with VllmDriver(args.vllm_python) as driver:
            cost = schedule_cost(driver)
        log(f"schedule() p50 at >= {cost['running_at_least']} running: kvengine {cost['kvengine_us_p50']} us, "
            f"vLLM {cost['vllm_us_p50']} us, ratio {cost['ratio']}")
    if args.json:
        print(json.dumps({"traces": len(seeds), "divergent": len(divergent), "first_divergence": first,
                          "errors": len(errors), "schedule_cost": cost}))
    return 1 if divergent or errors else 0


if __name__ == "__main__":
    sys.exit(main())
