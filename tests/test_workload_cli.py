"""`kvtune trace stats | convert | synth`, end to end through kvtune's own entry point
(`kvtune.cli.main`, in this process)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtune.workload import read_workload

from tracepaths import AZURE_CODE
from kvtune_cli import kvtune_main
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.0000000,110,27
2023-11-16 18:17:07.0000000,600,27
"""


@pytest.fixture
def azure(tmp_path) -> Path:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    return path


def row(out: str, label: str) -> str | None:
    """The value of one row of `trace stats`' table (its label, then the value), None without one."""
    return next((line.removeprefix(label).strip() for line in out.splitlines() if line.startswith(label + " ")),
                None)


def test_stats_json_is_the_last_line(capsys):
    assert kvtune_main("trace", "stats", AZURE_CODE, "--json") == 0
    out = capsys.readouterr().out
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["requests"] == 8819 and 3000 < stats["duration_s"] < 3900
    for key in ("rate_rps", "ideal_prefix_hit_rate", "distinct_prefix_blocks"):
        assert key in stats
    assert set(stats["input_len"]) == {"p50", "p95", "p99", "max", "mean"}
    # the table shows the JSON's figures: the hit rate as a percentage of the prompt tokens
    assert row(out, "ideal prefix hit rate").split()[:4] == [f"{100 * stats['ideal_prefix_hit_rate']:.1f}", "%",
                                                            "of", str(stats["prompt_tokens"])]
    assert row(out, "requests").split()[0] == str(stats["requests"])
    assert stats["hash_block_size"] is None and row(out, "hash block size") is None  # Azure has no hash ids


def test_stats_block_size_changes_the_hit_rate(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 24, "output_length": 1, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 1, "input_length": 24, "output_length": 1, "hash_ids": [1, 3]}\n'
                     '{"timestamp": 2, "input_length": 24, "output_length": 1, "hash_ids": [1, 4]}\n')
    rates = {}
    for block in (8, 16):
        assert kvtune_main("trace", "stats", trace, "--hash-block-size", 16, "--block-size", block, "--json") == 0
        rates[block] = json.loads(capsys.readouterr().out.splitlines()[-1])["ideal_prefix_hit_rate"]
    assert rates == {8: pytest.approx(32 / 72), 16: pytest.approx(32 / 72)}


def test_convert_applies_transforms_and_writes_kvtune_jsonl(azure, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert kvtune_main("trace", "convert", azure, out, "--head", 3, "--length-scale", 0.5,
                  "--max-input", 1000, "--rate-scale", 2) == 0
    assert "wrote 3 requests" in capsys.readouterr().out
    w = read_workload(out)
    assert [(r.input_length, r.output_length) for r in w] == [(1000, 5), (1000, 4), (55, 14)]
    assert [r.arrival_s for r in w] == pytest.approx([0.0, 0.026, 0.51002])


def test_convert_retime_and_sample(azure, tmp_path):
    out = tmp_path / "out.jsonl"
    assert kvtune_main("trace", "convert", azure, out, "--sample", "0.5", "--seed", "4",
                  "--retime-rate", 10, "--burstiness", "inf") == 0
    assert [r.arrival_s for r in read_workload(out)] == [0.0, 0.1]


def test_error_prints_message_returns_2_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
                   '{"timestamp": 1, "input_length": -3, "output_length": 1}\n')
    out = tmp_path / "out.jsonl"
    assert kvtune_main("trace", "convert", bad, out) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and 'bad.jsonl:2: field "input_length"' in err
    assert not out.exists()
    assert kvtune_main("trace", "stats", tmp_path / "missing.csv") == 2
    assert "error:" in capsys.readouterr().err


def test_skip_bad_says_how_many(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{oops\n')
    assert kvtune_main("trace", "stats", bad, "--skip-bad") == 0
    assert "skipped 1 bad records" in capsys.readouterr().err


def test_synth_writes_a_trace(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert kvtune_main("trace", "synth", "-o", out, "--num-requests", 60, "--rate", 4, "--turns", "1-3",
                  "--think-time", 5, "--input-len", "lognormal:200,0.5", "--output-len", "10-50",
                  "--system-prompts", 2, "--system-prompt-len", 64, "--seed", 3) == 0
    assert "wrote 60 requests" in capsys.readouterr().out
    w = read_workload(out)
    assert len(w) == 60 and w.hash_block_size == 16
    assert kvtune_main("trace", "stats", out, "--json") == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert stats["ideal_prefix_hit_rate"] > 0.2 and stats["sessions"] > 10


def test_synth_bad_distribution_is_an_error(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert kvtune_main("trace", "synth", "-o", out, "--input-len", "lots") == 2
    assert "error: bad distribution 'lots'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("command, expected", [
    ("stats", "--block-size"), ("convert", "--retime-rate"), ("synth", "--system-prompt-shares"),
])
def test_every_command_has_help(command, expected, capsys):
    with pytest.raises(SystemExit) as done:
        kvtune_main("trace", command, "--help")
    assert done.value.code == 0
    assert expected in capsys.readouterr().out


def test_trace_without_subcommand_shows_usage(capsys):
    assert kvtune_main("trace") == 2
    assert "stats" in capsys.readouterr().err
