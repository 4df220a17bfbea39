"""The probe plan: what each probe sends, and which of the cost model's terms it times.

A live server shows only client-side timings, so each probe isolates a few
terms of the cost model, alone on an idle server:

* prefill:  one request of prompt length L, max_tokens 1. Its TTFT is the
            prefill step(s) of L tokens, plus the client overhead (HTTP,
            parsing, queueing to the engine and back).
* overhead: a tiny prompt decoding a few tokens; TTFT minus the steady ITL of
            the same request pins the client overhead apart from the step's.
* decode:   B requests of a short prompt decoding together (ignore_eos); the
            inter-token gap while all B decode is one decode step of B
            sequences (the weights read, the per-step and per-sequence terms).
* context:  B requests with long prompts decoding: the K/V read (and decode
            attention) term.
* prefix:   a warm-up request fills the prefix cache, then a request sharing
            its first P tokens: the prefill computes only the rest, attending
            over the whole context.
* loaded:   B requests of varied prompt lengths decode while short requests
            arrive one by one, as under real traffic: their TTFT is the rest of
            a decode step, then a mixed step (their prefill with the batch's
            decodes), plus the client overhead of a busy server; the batch's
            typical gap is a decode step over uneven contexts. In two of them
            (one with --quick) the arrivals share a warm prefix (a system prompt
            under traffic).

The plan starts and ends with the same decode probe (B=4, or the largest batch
allowed below that), DRIFT_CHECKS times at each end, between the first and the last
few other probes: the median of the closing ones against that of the opening ones
(`timings.speed_drift`) says how much the server's speed moved while it was probed, which a
fit cannot tell from the cost model's own misfit. All of them are fitted, as one
probe (`timings.merge_repeated`).

Every prompt is fresh random token ids (except the shared prefixes), drawn
anew each run (`probe_prompts`), so no probe hits another's cached blocks, nor those
an earlier calibration of the server left.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import numpy as np

TOKEN_LOW, TOKEN_HIGH = 1000, 30000  # the workload module's prompt token range
TTFT, ITL = "ttft", "itl"
PREFILL_TIME = "prefill_time"  # the server's own: first scheduled to first token
DECODE_LEN = 32  # a decode probe's prompt
DECODE_REPEATS = 3  # trials of each decode probe
LOADED_ARRIVALS = 12  # requests arriving one by one during a loaded probe
LOADED_FIRST, LOADED_SPACING = 6, 5  # background tokens before the first arrival, and between arrivals
PROBE_KINDS = ("overhead", "prefill", "decode", "context", "prefix", "loaded")
# The drift check's runs at each end of the plan. One run a side read the same quiet server
# anywhere from -32% to +31% apart: a hiccup of a shared machine (another process's burst, a
# GC pause) lands in one run and moves its whole median. Three runs a side, apart in time (a
# probe between each), are moved only by what lasts over two of them, so the medians' ratio
# is the server's speed, not one run's luck; it costs four more short decode probes.
DRIFT_CHECKS = 3
POOL_SHARE = 0.8  # of the KV pool a probe may hold at once: a margin so that no probe is preempted


@dataclass(frozen=True)
class Probe:
    """One measurement: `batch` concurrent requests of `prompt_len` tokens, `max_tokens`
    each; with `prefix_len`, a warm-up request of the first `prefix_len` tokens plus
    `warm_suffix` of its own goes first. Measured (`measures`): the first request's
    TTFT, and/or the steady inter-token gap while all `batch` requests decode.

    With `background` B: B requests (prompts of `background_len` tokens and shorter)
    decode while `repeats` requests of `prompt_len` arrive one after another (a
    "loaded" probe): their TTFT, and the background's gap. With `prefix_len` as well,
    one warm-up goes first and every arrival shares its prefix (a system prompt's hits
    under traffic)."""

    kind: str
    label: str
    prompt_len: int
    max_tokens: int
    measures: tuple[str, ...]
    batch: int = 1
    prefix_len: int = 0
    warm_suffix: int = 0
    repeats: int = 1
    background: int = 0
    background_len: int = 0

    @property
    def num_requests(self) -> int:
        warmups = (1 if self.background else self.repeats) if self.prefix_len else 0
        return self.repeats * self.batch + warmups + self.background

    def background_tokens(self) -> int:
        """Tokens each background request is asked for: enough to outlast every arrival."""
        return LOADED_FIRST + LOADED_SPACING * self.repeats + 4 * LOADED_SPACING

    def kv_tokens(self, block_size: int = 1) -> int:
        """The most KV the probe holds at once: each batch request's whole context; for a loaded
        probe the background's and two arrivals' (one answered, the next sent). Each request's
        is rounded up to whole blocks of `block_size`: a pool of 8 blocks of 128 tokens holds
        8 decodes of 56 tokens, not 18."""
        def held(tokens: int) -> int:
            return -(-tokens // block_size) * block_size
        if not self.background:
            return self.batch * held(self.prompt_len + self.max_tokens)
        return (sum(held(n + self.background_tokens()) for n in self.background_lens())
                + 2 * held(self.prompt_len + self.max_tokens))

    def background_lens(self) -> list[int]:
        """The background's prompt lengths: spread from 32 to background_len (uneven
        contexts, as real batches have)."""
        if not self.background:
            return []
        lo = min(32, self.background_len)
        return [round(float(x)) for x in np.geomspace(lo, self.background_len, self.background)]


@dataclass
class ProbePlan:
    probes: list[Probe]
    notes: list[str] = field(default_factory=list)  # where the pool kept the plan from its design

    @property
    def num_requests(self) -> int:
        return sum(p.num_requests for p in self.probes)

    def __len__(self) -> int:
        return len(self.probes)


def _geometric(lo: int, hi: int, n: int) -> list[int]:
    if hi <= lo:
        return [lo]
    return sorted({round(float(x)) for x in np.geomspace(lo, hi, n)})


def design_probes(max_model_len: int, max_batch: int = 64, max_prompt: int | None = None,
                  pool_tokens: int | None = None, batch_tokens: int = 2048, quick: bool = False,
                  block_size: int = 1, kinds: tuple[str, ...] | None = None) -> ProbePlan:
    """The probe set for a server with this context limit.

    max_batch    the largest decode batch (keep it <= the server's max_num_seqs).
    max_prompt   the longest prompt (default: most of max_model_len).
    pool_tokens  the KV pool's size in tokens, when known: every probe's requests fit in it
                 at once (a batch the pool cannot hold runs in waves, and times other steps).
    block_size   the pool's block size: each request holds whole blocks.
    batch_tokens the server's token budget per step (max_num_batched_tokens): a long-context
                 batch decodes long enough to outlast its chunked prefills.
    quick        fewer lengths, batch sizes and repeats (a smoke run).
    kinds        only the probes of these PROBE_KINDS (the drift checks are decodes).
    """
    bounds = _PlanBounds(max_model_len, max(64, min(max_prompt or max_model_len, max_model_len - 64)), max_batch,
                         pool_tokens if pool_tokens else max_model_len * max_batch, block_size, batch_tokens, quick)
    notes: list[str] = []
    decodes = _decode_probes(bounds, notes)
    probes = [*_prefill_probes(bounds), *decodes, *_context_probes(bounds), *_prefix_probes(bounds),
              *_loaded_probes(bounds), *_loaded_prefix_probes(bounds)]
    if kinds is not None:
        probes = [p for p in probes if p.kind in kinds]
    check = min(4, max_batch, decodes[-1].batch)
    drift_check = Probe("decode", f"decode B={check} (drift check)", DECODE_LEN, bounds.decode_tokens, (ITL,),
                        batch=check, repeats=DECODE_REPEATS)
    return ProbePlan(_held_in_pool(_with_drift_checks(probes, drift_check), bounds), notes)


@dataclass(frozen=True)
class _PlanBounds:
    """What a plan's probes stay within: the server's context limit, the longest prompt, the
    largest decode batch, the KV pool (in tokens, of `block_size` blocks) and the step's token
    budget; `quick`: fewer lengths, batch sizes and repeats."""

    max_model_len: int
    longest: int
    max_batch: int
    pool: int
    block_size: int
    batch_tokens: int
    quick: bool

    @property
    def room(self) -> float:
        """The KV tokens one probe may hold at once."""
        return POOL_SHARE * self.pool

    @property
    def repeats(self) -> int:
        """Trials of each isolated TTFT probe."""
        return 3 if self.quick else 5

    @property
    def decode_tokens(self) -> int:
        """Tokens each decode and long-context request decodes."""
        return 24 if self.quick else 40


def _prefill_probes(bounds: _PlanBounds) -> list[Probe]:
    """The client overhead's probe, and prefills of lengths from 16 to the longest prompt."""
    longest, quick = bounds.longest, bounds.quick
    probes = [Probe("overhead", "overhead L=8", 8, 24, (TTFT, ITL), repeats=bounds.repeats)]
    # The short prefills pin the overheads; compute and attention show only in the long
    # ones, so the top octaves get extra lengths (two points there would fit any noise).
    top = max(16, longest // 8)
    lengths = sorted(set(_geometric(16, top, 3 if quick else 5)) | set(_geometric(top, longest, 4 if quick else 5)))
    for length in lengths:
        probes.append(Probe("prefill", f"prefill L={length}", length, 1, (TTFT,), repeats=bounds.repeats))
    return probes


def _decode_probes(bounds: _PlanBounds, notes: list[str]) -> list[Probe]:
    """Decodes of short prompts in batches of 1, 2, 4, ... up to the largest (every other one,
    quick), those the pool holds (_held_batches, which says in `notes` where it holds fewer)."""
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= bounds.max_batch]
    if bounds.quick:
        batches = batches[::2] + ([batches[-1]] if len(batches) % 2 == 0 else [])
    # Three trials each (their median): a decode probe lasts a fraction of a second, and one
    # hiccup of a shared machine in it moved a whole batch size's ITL by 20%.
    one = Probe("decode", "", DECODE_LEN, bounds.decode_tokens, (ITL,))
    return [Probe("decode", f"decode B={b}", DECODE_LEN, bounds.decode_tokens, (ITL,), batch=b,
                  repeats=DECODE_REPEATS)
            for b in _held_batches(batches, one, bounds.pool, bounds.block_size, notes)]


def _context_probes(bounds: _PlanBounds) -> list[Probe]:
    """Batches of long prompts decoding (those the pool holds), each long enough to outlast
    its chunked prefills."""
    longest, decode_tokens = bounds.longest, bounds.decode_tokens
    contexts = ([longest // 4, longest // 2, longest - decode_tokens] if not bounds.quick
                else [longest // 2, longest - decode_tokens])
    probes = []
    for length in contexts:
        for b in (1, 4, 16):
            context = Probe("context", "", length, decode_tokens, (ITL,), batch=b)
            if b <= bounds.max_batch and context.kv_tokens(bounds.block_size) <= bounds.room:
                prefill_steps = -(-b * length // bounds.batch_tokens)
                probes.append(Probe("context", f"context B={b} L={length}", length,
                                    decode_tokens + prefill_steps, (ITL,), batch=b))
    return probes


def _prefix_probes(bounds: _PlanBounds) -> list[Probe]:
    """Prefills of a short or a long suffix after a prefix a warm-up left in the cache."""
    longest, probes = bounds.longest, []
    for prefix in ([longest // 2] if bounds.quick else [longest // 4, longest // 2]):
        for suffix in (16, 256):
            if prefix + suffix < bounds.max_model_len - 8:
                probes.append(Probe("prefix", f"prefix P={prefix} S={suffix}", prefix + suffix, 1, (TTFT,),
                                    prefix_len=prefix, warm_suffix=suffix, repeats=bounds.repeats))
    return probes


def _background_len(bounds: _PlanBounds) -> int:
    """The longest prompt of a loaded probe's background."""
    return max(32, min(1024, bounds.longest // 4))


def _loaded_probes(bounds: _PlanBounds) -> list[Probe]:
    """Short and longer arrivals amid batches of decodes."""
    # Real traffic is mostly this regime, so it gets as many probes as the isolated decodes.
    loaded = [8] if bounds.quick else [2, 4, 8, 16, 32]
    probes = []
    for b in sorted({min(b, bounds.max_batch - 1) for b in loaded}):
        if b < 1:
            continue
        for length in (64, 512):
            length = min(length, bounds.longest)
            probes.append(Probe("loaded", f"loaded B={b} L={length}", length, 1, (TTFT, ITL),
                                repeats=LOADED_ARRIVALS, background=b, background_len=_background_len(bounds)))
    return probes


def _loaded_prefix_probes(bounds: _PlanBounds) -> list[Probe]:
    """Arrivals that hit a warm prefix amid decodes: the mixed steps a shared system prompt
    gives, whose chunks after context the isolated prefix probes price only alone."""
    prefix, suffix = min(1024, bounds.longest // 4), min(128, bounds.longest // 8)
    probes = []
    for b in sorted({min(b, bounds.max_batch - 1) for b in ([8] if bounds.quick else [4, 16])}):
        if b >= 1 and prefix + suffix < bounds.max_model_len - 8:
            probes.append(Probe("loaded", f"loaded prefix B={b} P={prefix} S={suffix}", prefix + suffix, 1,
                                (TTFT, ITL), prefix_len=prefix, warm_suffix=16, repeats=LOADED_ARRIVALS,
                                background=b, background_len=_background_len(bounds)))
    return probes


def _held_in_pool(probes: list[Probe], bounds: _PlanBounds) -> list[Probe]:
    """`probes`, each loaded probe's background cut to what the pool holds (_fit_pool); one it
    cannot hold, or cut to another's copy, dropped."""
    plan, loaded = [], []
    for probe in probes:
        probe = _fit_pool(probe, bounds.room, bounds.block_size)
        if probe is None or probe in loaded:  # a halved background may repeat another probe
            continue
        if probe.background:
            loaded.append(probe)
        plan.append(probe)
    return plan


def _held_batches(batches: list[int], one: Probe, pool_tokens: int, block_size: int, notes: list[str]) -> list[int]:
    """The decode batches whose requests (each like `one`) POOL_SHARE of the pool holds at once; where it holds
    fewer than the largest, the largest it holds takes their place, and `notes` says so: the fit
    then never sees a step of more sequences, and a search running more extrapolates."""
    per_request = one.kv_tokens(block_size)
    most = max(1, int(POOL_SHARE * pool_tokens // per_request))
    held = [b for b in batches if b <= most]
    if len(held) == len(batches):
        return batches
    if not held or held[-1] < most:
        held.append(most)
    blocks = f" in blocks of {block_size} tokens" if block_size > 1 else ""
    notes.append(f"the KV pool ({pool_tokens:,} tokens{blocks}) holds {most} decoding requests of "
                 f"{one.prompt_len + one.max_tokens} tokens at once, so the fit sees decode steps of at most "
                 f"{most} sequences (not {batches[-1]}); a config that runs more at once is priced by "
                 "extrapolation. Step costs do not depend on the pool's size: calibrate on a larger pool "
                 "(--kv-cache-memory-bytes, --gpu-memory-utilization) or a smaller --block-size to see them")
    return held


def _fit_pool(probe: Probe, room: float, block_size: int = 1) -> Probe | None:
    """A loaded probe whose background would outgrow the pool gets a smaller background
    (halved until it fits; None if none does): preempted, the background stalls while the
    others finish, and the probe times recomputation, not the steps it designs."""
    while probe.background and probe.kv_tokens(block_size) > room:
        if probe.background == 1:
            return None
        b = probe.background // 2
        probe = dataclasses.replace(probe, background=b, label=re.sub(r"B=\d+", f"B={b}", probe.label))
    return probe


def _with_drift_checks(probes: list[Probe], check: Probe, n: int = DRIFT_CHECKS) -> list[Probe]:
    """`probes` with `check` n times before, between and after the first n - 1 of them, and
    n times so around the last n - 1: each end's checks apart in time (see DRIFT_CHECKS)."""
    k = min(n - 1, len(probes) // 2)
    head, middle, tail = probes[:k], probes[k:len(probes) - k], probes[len(probes) - k:]
    opening = [p for probe in head for p in (check, probe)] + [check]
    closing = [check] + [p for probe in tail for p in (probe, check)]
    return opening + middle + closing


@dataclass
class ProbePrompts:
    """One repeat's prompts: the warm-up's (a prefix probe's; else None), and the measured ones."""

    warmup: list[int] | None
    prompts: list[list[int]]


def probe_prompts(probe: Probe, rng: np.random.Generator) -> ProbePrompts:
    """The prompts of one repeat: fresh random ids, the warm-up and the measured request
    sharing the first prefix_len tokens."""
    def fresh(n: int) -> list[int]:
        return rng.integers(TOKEN_LOW, TOKEN_HIGH, n).tolist()
    if probe.prefix_len:
        shared = fresh(probe.prefix_len)
        warm = shared + fresh(probe.warm_suffix)
        return ProbePrompts(warm, [shared + fresh(probe.prompt_len - probe.prefix_len) for _ in range(probe.batch)])
    return ProbePrompts(None, [fresh(probe.prompt_len) for _ in range(probe.batch)])
