"""benchmarks/verdict_stability.py without servers: which advice reruns agree on, where a verdict lists
configs equivalent to the one it recommends."""
import pytest
from benchscript import load_benchmark

DEFAULT = {"block_size": 128, "kv_cache_dtype": "auto"}
B16, B32, B64 = ({"block_size": b, "kv_cache_dtype": "auto"} for b in (16, 32, 64))


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("verdict_stability")


def rerun(bench, verdict: str, recommended: dict | None = None, equivalent: tuple = ()) -> dict:
    out = {"verdict": verdict, "recommended": recommended, "equivalent": list(equivalent)}
    return {"advice": bench.advice(out, DEFAULT), "equivalent_advice": bench.equivalent_advice(out, DEFAULT)}


def test_advice_one_verdict_lists_as_equivalent_agrees_with_a_rerun_that_recommends_it(bench):
    rows = [rerun(bench, "better", B16, (B16, B32)), rerun(bench, "better", B32, (B32, B64)),
            rerun(bench, "better", B32, (B32,)), rerun(bench, "keep_default")]
    assert [r["advice"] for r in rows] == ["set --block-size 16", "set --block-size 32", "set --block-size 32",
                                           "keep_default"]
    # strictly, 2 of 4 reruns recommend block 32; 3 of 4 stand behind it (the first lists it as equivalent)
    assert bench.consistency(rows) == ("set --block-size 32", 0.75)


def test_a_verdict_without_equivalents_is_its_own_advice(bench):
    rows = [rerun(bench, "infeasible"), rerun(bench, "infeasible"), rerun(bench, "smallest_change", B64)]
    assert rows[2]["equivalent_advice"] == ["set --block-size 64"]
    assert bench.consistency(rows) == ("infeasible", pytest.approx(2 / 3))
