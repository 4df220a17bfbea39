"""`kvtune trace convert --length-scale` on a Mooncake trace keeps the trace's prefix sharing.

Mooncake's hash ids cover 512 tokens each. Shrinking the prompts but not the blocks would put
most of a short prompt inside its first block, which nearly every request shares: the ideal prefix
hit rate would climb with every halving of the lengths. The blocks shrink with the lengths instead.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from kvtune.workload import read_workload, workload_stats
from kvtune_cli import kvtune_main

MOONCAKE_BLOCK = 512
REQUESTS = 300


def mooncake_trace(path: Path, seed: int = 0) -> Path:
    """Mooncake-format records: every prompt opens with block 0 (as in Mooncake's conversation
    trace), some with a system prompt of several blocks after it, some with an earlier request's
    full blocks (a later turn of its conversation), then a tail of its own."""
    rng = np.random.default_rng(seed)
    fresh = itertools.count(1)
    systems = [[0] + [next(fresh) for _ in range(n)] for n in (0, 2, 4, 7)]
    turns: list[list[int]] = []
    records = []
    for i in range(REQUESTS):
        if turns and rng.random() < 0.2:
            shared = turns[rng.integers(len(turns))]
        else:
            shared = systems[rng.choice(len(systems), p=[0.55, 0.2, 0.15, 0.1])]
        tail = int(rng.integers(1, 8000))
        length = MOONCAKE_BLOCK * len(shared) + tail
        ids = shared + [next(fresh) for _ in range(-(-tail // MOONCAKE_BLOCK))]
        turns.append(ids[: length // MOONCAKE_BLOCK])
        records.append({"timestamp": 250 * i, "input_length": length,
                        "output_length": int(rng.integers(1, 800)), "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return mooncake_trace(tmp_path_factory.mktemp("mooncake") / "mooncake.jsonl")


@pytest.fixture(scope="module")
def original(trace) -> dict[int, dict]:
    """The unscaled trace's statistics, by cache block size."""
    workload = read_workload(trace)
    return {block: workload_stats(workload, block) for block in (16, 1)}


def stats(path: Path, capsys, *options: object) -> tuple[dict, str]:
    assert kvtune_main("trace", "stats", path, "--json", *options) == 0
    out = capsys.readouterr().out
    return json.loads(out.splitlines()[-1]), out


def rounding_tolerance(original: dict, scaled: dict, scale: float, hash_block: int, cache_block: int) -> float:
    """How far the scaled trace's ideal hit rate may be from the original's, from rounding alone.

    Per request, scaled by f with hash blocks of b' = round(512 f) tokens, against f times the
    original: its cached tokens move by |b' - 512 f| for each of its cached hash blocks (a block's
    rounding), by under one cache block (cached tokens are cut to whole cache blocks: 512 is a
    multiple of the cache block, b' need not be) and by 1.5 tokens for its length's rounding (the
    last prompt token is never served); its prompt tokens by 0.5. Summed over the N requests and
    divided by the scaled prompt tokens, that bounds |H' - H|.
    """
    requests = original["requests"]
    cached_blocks = original["ideal_cached_tokens"] / MOONCAKE_BLOCK
    cached_error = cached_blocks * abs(hash_block - MOONCAKE_BLOCK * scale) + requests * (cache_block - 1 + 1.5)
    prompt_error = original["ideal_prefix_hit_rate"] * requests * 0.5
    return (cached_error + prompt_error) / scaled["prompt_tokens"]


@pytest.mark.parametrize("cache_block", [16, 1])
@pytest.mark.parametrize("scale, hash_block", [(1, 512), (0.25, 128), (0.1, 51), (0.05, 26)])
def test_length_scale_keeps_the_ideal_prefix_hit_rate(tmp_path, capsys, trace, original, scale, hash_block,
                                                      cache_block):
    original = original[cache_block]
    assert 0.2 < original["ideal_prefix_hit_rate"] < 0.6
    out = tmp_path / "small.jsonl"
    assert kvtune_main("trace", "convert", trace, out, "--length-scale", scale) == 0
    capsys.readouterr()
    scaled, text = stats(out, capsys, "--block-size", cache_block)

    rate, expected = scaled["ideal_prefix_hit_rate"], original["ideal_prefix_hit_rate"]
    if scale == 1:
        assert rate == expected
    else:
        assert rate == pytest.approx(expected, abs=rounding_tolerance(original, scaled, scale, hash_block,
                                                                      cache_block))

    # the block size travels in the converted file: stats of it, told nothing, uses it and says so
    first = json.loads(out.read_text().splitlines()[0])
    assert first.get("hash_block_size", MOONCAKE_BLOCK) == hash_block
    assert original["hash_block_size"] == MOONCAKE_BLOCK and scaled["hash_block_size"] == hash_block
    said = next(line for line in text.splitlines() if line.startswith("hash block size "))
    assert said.split()[3] == str(hash_block)  # the table's hash block size, the converted file's
