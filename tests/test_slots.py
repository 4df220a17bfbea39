"""cluster.slots.slot_check: a slot whose runs are all lower than their configs' means beyond the spread
is flagged; slots that differ only by noise are not. No Ray needed: it reads stored slots."""
from kvtune.cluster.slots import slot_check

A = {"node": "10.0.0.1", "node_id": "aaaa", "gpus": ["0"]}
B = {"node": "10.0.0.1", "node_id": "aaaa", "gpus": ["1"]}
C = {"node": "10.0.0.2", "node_id": "bbbb", "gpus": ["0"]}


def _rounds(slow: float) -> list:
    """Six rounds of two configs (values 10 and 20), two per slot; slot C's rounds `slow` times lower."""
    noise = [1.0, 1.01, 0.99, 1.005, 0.995, 1.0]
    runs = []
    for i, slot in enumerate([A, B, C, A, B, C]):
        factor = noise[i] * (slow if slot is C else 1.0)
        runs += [(slot, "default", 10 * factor), (slot, "trial 3", 20 * factor * noise[-1 - i])]
    return runs


def test_a_slot_slower_beyond_the_spread_is_flagged_and_only_it():
    rows = {r.slot.gpus + (r.slot.node_id,): r for r in slot_check(_rounds(0.8))}
    assert [r.slower for r in rows.values()] == [False, False, True]
    assert all(r.runs == 4 and r.configs == 2 for r in rows.values())
    assert rows[("0", "bbbb")].ratio.mean < 0.9 < rows[("0", "aaaa")].ratio.mean


def test_slots_that_differ_by_noise_are_not_flagged():
    assert not any(r.slower for r in slot_check(_rounds(1.0)))
