"""Where a live run ran on a Ray cluster (its slot: a node and the GPUs Ray gave it), and whether a
slot was slower than the others beyond the runs' spread.

Stage 2 on Ray keeps each round (every config once) on one slot, so the slot is a block: every
config meets every slot equally and a slow slot lowers all of them alike. `slot_check` tests it:
each run's value is divided by its config's mean over all its runs (which takes the configs'
differences out, a two-way layout of config × slot), and each slot's ratios are compared with the
other slots' by a one-sided Welch t-test (`stats.welch`), Holm-corrected over the slots
(`stats.holm`) at ALPHA. A slot it flags ran its rounds slower than the others by more than the
runs' own spread. Nothing here imports Ray: the report reads stored slots.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..search.stats import Interval, holm, interval, welch

ALPHA = 0.05


@dataclass(frozen=True)
class Slot:
    """A node and the GPU ids Ray assigned a task on it (empty on a node without GPUs)."""
    node: str  # the node's IP address
    node_id: str  # Ray's node id (two nodes on one host share an address)
    gpus: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"node": self.node, "node_id": self.node_id, "gpus": list(self.gpus)}

    @classmethod
    def of(cls, stored: dict) -> Slot:
        return cls(stored.get("node", "?"), stored.get("node_id", ""), tuple(map(str, stored.get("gpus") or ())))

    @property
    def label(self) -> str:
        gpus = f"GPU {','.join(self.gpus)}" if self.gpus else "no GPU"
        return f"{self.node} (node {self.node_id[:8]}) {gpus}"


@dataclass(frozen=True)
class SlotRow:
    """One slot's runs in `slot_check`: how many, of how many configs, its values' mean ratio to their
    configs' means, and the test's p-value of it being lower than the other slots' (None: too few runs)."""
    slot: Slot
    runs: int
    configs: int
    ratio: Interval | None
    p: float | None
    slower: bool


def slot_check(runs: list[tuple[dict, object, float]]) -> list[SlotRow]:
    """`runs`: (stored slot, config key, value) of each completed live run. One row per slot, in
    the order first seen (the module's docstring says how a slot is judged slower)."""
    by_config: dict = {}
    for _slot, key, value in runs:
        by_config.setdefault(key, []).append(value)
    means = {key: sum(vs) / len(vs) for key, vs in by_config.items()}
    ratios: dict[Slot, list[tuple[object, float]]] = {}
    for stored, key, value in runs:
        if means[key]:
            ratios.setdefault(Slot.of(stored), []).append((key, value / means[key]))
    tests = {}
    for slot, mine in ratios.items():
        others = [r for s, rs in ratios.items() if s != slot for _k, r in rs]
        a, b = interval([r for _k, r in mine]), interval(others)
        diff = welch(b, a) if a is not None and b is not None else None  # the others' mean higher than this slot's
        if diff is not None:
            tests[slot] = diff.p
    flagged = holm(tests, ALPHA) if tests else set()
    return [SlotRow(slot, len(mine), len({k for k, _r in mine}), interval([r for _k, r in mine]), tests.get(slot),
                    slot in flagged) for slot, mine in ratios.items()]
