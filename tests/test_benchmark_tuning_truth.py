"""benchmarks/tuning_truth.py without servers: the concordance over the pairs the grid separates,
and a saved grid read back only for the inputs it was measured on."""
import argparse
import json

import pytest
from benchscript import load_benchmark

from kvtune.search.stats import Interval


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("tuning_truth")


def test_only_pairs_the_grid_separates_count(bench):
    ivs = [Interval(20, 19, 21, 3), Interval(20.5, 19.5, 21.5, 3), Interval(10, 9, 11, 3), Interval(30, 29, 31, 3)]
    # The first two overlap: whatever the sim says of them is not scored.
    score, pairs = bench.separated_concordance([1.0, 5.0, 0.5, 9.0], ivs)
    assert pairs == 5 and score == 1.0
    # The sim puts the 10 req/s config above all three: discordant with both 20s and with the 30.
    score, pairs = bench.separated_concordance([1.0, 5.0, 10.0, 9.0], ivs)
    assert pairs == 5 and score == pytest.approx((2 - 3) / 5)
    # A sim tie is neither concordant nor discordant.
    score, _ = bench.separated_concordance([1.0, 1.0, 1.0, 1.0], ivs)
    assert score == 0.0
    assert bench.separated_concordance([1.0, 2.0], ivs[:2]) == (None, 0)


def _args(**changes):
    args = argparse.Namespace(server="engine", repeats=3, requests=64, rate=32.0, input_len="96-192",
                              output_len="24-48", pool_bytes=2 << 20, slo=["ttft_p95=2s"],
                              grid=((32, 128), (8,), ("auto", "fp8")))
    for k, v in changes.items():
        setattr(args, k, v)
    return args


def test_a_saved_grid_is_read_back_for_its_own_inputs_only(bench, tmp_path):
    params = {"block_size": 32, "max_num_seqs": 8, "kv_cache_dtype": "fp8"}
    cell = {"params": params, "values": [20.0, 21.0, None], "feasible": [True, True], "errors": ["x"]}
    path = tmp_path / "grid.json"
    bench.save_grid(path, {bench.key(params): cell}, 12.5, _args())
    grid, grid_s = bench.load_grid(str(path), _args())
    assert grid_s == 12.5 and grid[(32, 8, "fp8")]["values"] == [20.0, 21.0, None]
    with pytest.raises(SystemExit) as err:
        bench.load_grid(str(path), _args(rate=16.0, pool_bytes=1 << 20))
    assert "rate 32.0 (saved) vs 16.0" in str(err.value) and "pool_bytes" in str(err.value)
    assert json.loads(path.read_text())["inputs"]["grid"] == [[32, 128], [8], ["auto", "fp8"]]


def test_a_grid_file_that_is_missing_or_not_a_grid_is_named(bench, tmp_path):
    with pytest.raises(SystemExit) as err:
        bench.load_grid(str(tmp_path / "none.json"), _args())
    assert "none.json: cannot read it" in str(err.value)
    for text in ("not json", '{"inputs": 3}', '{"inputs": {}, "cells": [{}], "grid_s": 1}'):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(SystemExit) as err:
            bench.load_grid(str(tmp_path / "bad.json"), _args())
        assert "is not a grid.json that tuning_truth saved" in str(err.value)


def test_repeated_searches_are_scored_by_their_shares(bench):
    """Three searches against one grid: the shares count a search that printed nothing as missing."""
    def search(verdict, over, tied, block):
        return {"verdict": verdict, "verdict_right": verdict == "better", "recommended_over_best": over,
                "tied_with_best": tied, "advice": f"set block {block}" if verdict == "better" else verdict}
    shares = bench.search_shares([search("better", 0.97, False, 32), search("better", 0.9, True, 32),
                                  search("keep_default", None, None, 0)], 4)
    assert shares["share_verdict_right"] == 0.5 and shares["share_recommended_goal"] == 0.5
    assert shares["share_same_advice"] == 0.5 and shares["advice"] == {"set block 32": 2, "keep_default": 1}
