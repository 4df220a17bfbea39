"""Synthetic workloads: arrivals, lengths, shared system prompts, multi-turn sessions.

Sessions start by an arrival process at `rate` per second (a single-turn
session is one request, so then `rate` is the request rate). Prefix sharing is
written as hash ids, so it survives the trip through a kvtune JSONL file and
into any server:

* A session may open with one of `system_prompts` shared system prompts of
  `system_prompt_len` tokens (prompt i is picked with probability
  `system_prompt_shares[i]`, the rest of the traffic gets none); the user's
  message (`input_len` tokens) follows it.
* Turn k+1 of a session sends turn k's prompt, its answer and a new user
  message (`input_len` tokens), `think_time_s` (mean of an exponential) after
  turn k arrived.

Hash ids stand for whole blocks: an id shared by two prompts must mean the
same `hash_block_size` tokens. So only *full* blocks are shared: a system
prompt's partial last block, and turn k's partial last block (which turn k+1
fills with the answer), get fresh ids where the prompt continues. The ideal
hit rate therefore undercounts true sharing by less than one hash block per
shared prefix; the default `hash_block_size` of 16 (vLLM's default block
size) keeps that small. Everything is drawn from one generator seeded by
`seed`: the same spec gives the same workload.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .arrivals import gamma_gaps
from .dist import IntDist
from .model import TraceRequest, Workload, blocks_for

ARRIVALS = {"poisson": 1.0, "gamma": None, "constant": math.inf}  # name -> burstiness (None: the spec's)


@dataclass
class SynthSpec:
    num_requests: int | None = 100
    duration_s: float | None = None
    rate: float = 1.0
    arrival: str = "poisson"
    burstiness: float = 1.0
    input_len: IntDist = field(default_factory=lambda: IntDist.fixed(512))
    output_len: IntDist = field(default_factory=lambda: IntDist.fixed(128))
    system_prompts: int = 0
    system_prompt_len: int = 0
    system_prompt_shares: tuple[float, ...] | None = None  # None: all traffic, split evenly
    turns: IntDist = field(default_factory=lambda: IntDist.fixed(1))
    think_time_s: float = 0.0
    max_input: int | None = None
    hash_block_size: int = 16
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first inconsistent setting."""
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of num_requests and duration_s")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not (0 < self.duration_s < math.inf):
            raise ValueError(f"duration_s must be a finite number > 0, got {self.duration_s}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 sessions/s (inf: all at t=0), got {self.rate}")
        if math.isinf(self.rate) and self.duration_s is not None:
            raise ValueError("an infinite rate needs a request count, not a duration")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.system_prompts < 0 or (self.system_prompts and self.system_prompt_len < 1):
            raise ValueError("system prompts need a count >= 0 and a length >= 1")
        shares = self.shares()
        if len(shares) != self.system_prompts or min(shares, default=0) < 0 or sum(shares) > 1 + 1e-9:
            raise ValueError(f"system_prompt_shares needs {self.system_prompts} shares >= 0 summing to <= 1")
        if not self.think_time_s >= 0:
            raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")
        if self.max_input is not None and self.max_input < 1:
            raise ValueError(f"max_input must be >= 1, got {self.max_input}")
        if self.hash_block_size < 1:
            raise ValueError(f"hash_block_size must be >= 1, got {self.hash_block_size}")

    def shares(self) -> tuple[float, ...]:
        if self.system_prompt_shares is not None:
            return tuple(self.system_prompt_shares)
        return (1.0 / self.system_prompts,) * self.system_prompts if self.system_prompts else ()

    @property
    def multi_turn(self) -> bool:
        return self.turns != IntDist.fixed(1)


def synthesize(spec: SynthSpec) -> Workload:
    """The workload `spec` describes; deterministic in `spec.seed`."""
    spec.check()
    # Separate streams: how many gaps are drawn ahead never shifts the lengths.
    arrival_rng, rng = (np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(2))
    fresh_ids = itertools.count()
    systems = [tuple(itertools.islice(fresh_ids, spec.system_prompt_len // spec.hash_block_size))
               for _ in range(spec.system_prompts)]
    requests: list[TraceRequest] = []
    for number, start in enumerate(_session_starts(spec, arrival_rng)):
        if spec.num_requests is not None and len(requests) >= spec.num_requests:
            break
        system = _pick_system_prompt(spec, rng)
        opening = (systems[system], spec.system_prompt_len) if system is not None else ((), 0)
        session_id = f"session-{number}" if spec.multi_turn else None
        budget = None if spec.num_requests is None else spec.num_requests - len(requests)
        requests.extend(_session(spec, rng, start, opening, session_id, fresh_ids, budget))
    requests.sort(key=lambda r: r.arrival_s)
    return Workload(requests, spec.hash_block_size, f"synth(seed={spec.seed})")


def _session(spec: SynthSpec, rng: np.random.Generator, start: float, opening: tuple[tuple[int, ...], int],
             session_id: str | None, fresh_ids: Iterator[int], budget: int | None) -> list[TraceRequest]:
    """One session's turns; each prompt extends the last prompt and its answer."""
    shared_ids, history = opening
    arrival, turns = start, spec.turns.draw(rng)
    requests = []
    for turn in range(turns if budget is None else min(turns, budget)):
        if spec.duration_s is not None and arrival >= spec.duration_s:
            break
        length = history + spec.input_len.draw(rng)
        if spec.max_input is not None and length > spec.max_input:
            if turn > 0:
                break  # the conversation no longer fits: it ends here
            length = spec.max_input
        ids = _prompt_ids(shared_ids, length, spec.hash_block_size, fresh_ids)
        output = spec.output_len.draw(rng)
        requests.append(TraceRequest(arrival, length, output, ids, session_id=session_id))
        shared_ids, history = ids[: length // spec.hash_block_size], length + output
        arrival += rng.exponential(spec.think_time_s) if spec.think_time_s else 0.0
    return requests


def _prompt_ids(shared: tuple[int, ...], length: int, hash_block_size: int,
                fresh_ids: Iterator[int]) -> tuple[int, ...]:
    count = blocks_for(length, hash_block_size)
    kept = shared[:count]
    return kept + tuple(itertools.islice(fresh_ids, count - len(kept)))


def _pick_system_prompt(spec: SynthSpec, rng: np.random.Generator) -> int | None:
    if not spec.system_prompts:
        return None
    draw = rng.random()
    for index, edge in enumerate(np.cumsum(spec.shares())):
        if draw < edge:
            return index
    return None


def _session_starts(spec: SynthSpec, rng: np.random.Generator) -> Iterator[float]:
    """Session start times from 0; endless unless the spec has a duration."""
    burstiness = ARRIVALS[spec.arrival] or spec.burstiness
    now = 0.0
    while True:
        for gap in gamma_gaps(1024, spec.rate, burstiness, rng):
            if spec.duration_s is not None and now >= spec.duration_s:
                return
            yield now
            now += float(gap)
