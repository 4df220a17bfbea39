"""Every kind of bad input raises TraceError naming file, line and field; with
skip_bad the bad records are skipped and counted instead."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtune.workload import TraceError, TraceWarning, read_workload

GOOD = '{"timestamp": 0, "input_length": 10, "output_length": 2}'


def jsonl(*records: str) -> str:
    return "\n".join(records) + "\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_message_reads_file_line_field_expected_got(tmp_path):
    bad = '{"timestamp": 5, "input_length": -3, "output_length": 2}'
    path = write(tmp_path, "traces.jsonl", jsonl(*[GOOD] * 6, bad))
    with pytest.raises(TraceError) as caught:
        read_workload(path)
    assert str(caught.value) == f'{path}:7: field "input_length": expected an integer >= 1, got -3'
    assert (caught.value.line, caught.value.field) == (7, "input_length")


JSONL_CASES = [
    ("{not json", None, "invalid JSON"),
    ('[1, 2]', None, "a JSON object"),
    ('{"timestamp": 0, "input_length": 10}', "output_length", "missing"),
    ('{"input_length": 10, "output_length": 2}', "timestamp", "missing"),
    ('{"timestamp": "0", "input_length": 10, "output_length": 2}', "timestamp", "a number"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 2}', "timestamp", ">= 0"),
    ('{"timestamp": 0, "input_length": "10", "output_length": 2}', "input_length", "an integer >= 1"),
    ('{"timestamp": 0, "input_length": 2.5, "output_length": 2}', "input_length", "an integer >= 1"),
    ('{"timestamp": 0, "input_length": true, "output_length": 2}', "input_length", "an integer >= 1"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 0}', "output_length", "got 0"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 2}', "input_length", "got 0"),
    ('{"timestamp": 0, "input_length": 1025, "output_length": 2, "hash_ids": [1, 2]}',
     "hash_ids", "3 ids (ceil(input_length 1025 / hash_block_size 512)), got 2"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": "1"}', "hash_ids", "a list"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [-1]}', "hash_ids", ">= 0"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "prompt": 5}', "prompt", "a string"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 2, "prompt_token_ids": [1, 2]}',
     "prompt_token_ids", "3 ids (input_length), got 2"),
    ('{"timestamp": 0, "input_length": 2, "output_length": 2, "prompt_token_ids": [1, -2]}',
     "prompt_token_ids", "a list of integers >= 0"),
    ('{"timestamp": 0, "input_length": 2, "output_length": 2, "prompt_token_ids": "1 2"}',
     "prompt_token_ids", "a list of integers >= 0"),
]


@pytest.mark.parametrize("record, field, expected", JSONL_CASES)
def test_bad_kvtune_records(tmp_path, record, field, expected):
    path = write(tmp_path, "t.jsonl", jsonl(GOOD, "", record))
    with pytest.raises(TraceError) as caught:
        read_workload(path, "kvtune")
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ")
    assert expected in message
    if field:
        assert f'field "{field}"' in message and caught.value.field == field


@pytest.mark.parametrize("name, text, line, field", [
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,5,1\n"
              "2023-11-16 18:17:04.0,-3,1\n", 3, "ContextTokens"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,1\n", 2, "TIMESTAMP"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,5,x\n", 2,
     "GeneratedTokens"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,5\n", 2, None),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
              "1,ChatGPT,0,5,5,API log\n", 2, "Request tokens"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
              "soon,ChatGPT,3,5,8,API log\n", 2, "Timestamp"),
    ("c.jsonl", '{"prompt": "hi", "output_tokens": 2}\n{"prompt": "hi"}\n', 2, "output_tokens"),
    ("c.jsonl", '{"prompt": "", "output_tokens": 2}\n', 1, "prompt"),
])
def test_bad_csv_and_custom_records(tmp_path, name, text, line, field):
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError) as caught:
        read_workload(path)
    assert str(caught.value).startswith(f"{path}:{line}: ")
    assert caught.value.field == field
    if field:
        assert f'field "{field}"' in str(caught.value)


def test_bad_sharegpt_turn_names_the_line_and_turn(tmp_path):
    items = [
        {"id": "a", "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]},
    ]
    path = write(tmp_path, "s.json", "[\n" + ",\n".join(json.dumps(i) for i in items) + "\n]\n")
    with pytest.raises(TraceError) as caught:
        read_workload(path)
    assert str(caught.value).startswith(f"{path}:3: ")
    assert 'field "conversations[1].from"' in str(caught.value) and '"robot"' in str(caught.value)


def test_sharegpt_syntax_error_is_located(tmp_path):
    path = write(tmp_path, "s.json", '[\n{"id": "a", "conversations": []},\n{"id": oops}\n]')
    with pytest.raises(TraceError, match=r"s\.json:3: invalid JSON"):
        read_workload(path, "sharegpt")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = write(tmp_path, "empty.jsonl", content)
    with pytest.raises(TraceError, match=r"empty\.jsonl: empty file"):
        read_workload(path)


@pytest.mark.parametrize("name, content", [
    ("notes.md", "# Meeting notes\n\n- buy milk\n"),
    ("config.json", '{\n  "model": "llama"\n}\n'),
    ("other.jsonl", '{"model": "llama", "steps": 3}\n'),
    ("data.csv", "name,age\nann,3\n"),
])
def test_not_a_trace(tmp_path, name, content):
    path = write(tmp_path, name, content)
    with pytest.raises(TraceError, match=rf"{name}:\d+: not a recognised trace"):
        read_workload(path)


def test_binary_file_is_not_a_trace(tmp_path):
    path = tmp_path / "image.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    with pytest.raises(TraceError, match=r"image\.png: not a trace"):
        read_workload(path)


def test_wrong_explicit_format_reports_the_header(tmp_path):
    path = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,5,1\n")
    with pytest.raises(TraceError, match=r"a\.csv:1: expected the BurstGPT header"):
        read_workload(path, "burstgpt")


def test_skip_bad_skips_and_counts(tmp_path):
    path = write(tmp_path, "t.jsonl", jsonl(GOOD, "{broken", GOOD.replace("10", "-1"), GOOD))
    with pytest.warns(TraceWarning, match=r"skipped 2 bad records \(first: .*t\.jsonl:2: "):
        w = read_workload(path, skip_bad=True)
    assert len(w) == 2 and w.skipped == 2


def test_skip_bad_with_nothing_left_still_fails(tmp_path):
    path = write(tmp_path, "t.jsonl", jsonl("{broken", GOOD.replace("10", "0")))
    with pytest.warns(TraceWarning), pytest.raises(TraceError, match="no requests to replay"):
        read_workload(path, skip_bad=True)


def test_mixed_hash_block_sizes_are_rejected(tmp_path):
    records = ['{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1, 2], "hash_block_size": 16}',
               '{"timestamp": 1, "input_length": 20, "output_length": 1, "hash_ids": [1], "hash_block_size": 32}']
    path = write(tmp_path, "t.jsonl", jsonl(*records))
    with pytest.raises(TraceError, match=r't\.jsonl:2: field "hash_block_size": expected 16'):
        read_workload(path)


def test_unknown_format_name(tmp_path):
    with pytest.raises(ValueError, match="unknown trace format"):
        read_workload(write(tmp_path, "t.jsonl", GOOD), "parquet")


AZURE_ROW = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,5,1\n2023-11-16 18:17:04.0,{},{}\n"
BURST_ROW = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,3,5,8,API log\n2,ChatGPT,{},{},0,API log\n"


@pytest.mark.parametrize("name, text, line, field", [
    ("t.jsonl", jsonl(GOOD, '{"timestamp": 1, "input_length": 200000000, "output_length": 2}'), 2, "input_length"),
    ("t.jsonl", jsonl(GOOD, '{"timestamp": 1, "input_length": 1e12, "output_length": 2}'), 2, "input_length"),
    ("t.jsonl", jsonl(GOOD, '{"timestamp": 1, "input_length": 5, "output_length": 1e12}'), 2, "output_length"),
    ("t.jsonl", jsonl('{"timestamp": 1, "input_length": 9999999, "output_length": 2}'), 1, "output_length"),
    ("a.csv", AZURE_ROW.format(200000000, 1), 3, "ContextTokens"),
    ("a.csv", AZURE_ROW.format(9999999, 2), 3, "GeneratedTokens"),
    ("b.csv", BURST_ROW.format(3, 1000000000000), 3, "Response tokens"),
    ("c.jsonl", '{"prompt": "hi", "output_tokens": 200000000}\n', 1, "output_tokens"),
])
def test_lengths_no_request_can_have_are_rejected_at_read_time(tmp_path, name, text, line, field):
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError) as caught:
        read_workload(path)
    assert str(caught.value).startswith(f'{path}:{line}: field "{field}": expected ')
    assert "10000000" in str(caught.value) and caught.value.field == field


def test_a_sharegpt_conversation_too_long_for_one_request_is_rejected(tmp_path):
    items = [{"id": "a", "conversations": [{"from": "human", "value": "x" * 10**7}, {"from": "gpt", "value": "y"}]}]
    path = write(tmp_path, "s.json", json.dumps(items))
    with pytest.raises(TraceError, match=r's\.json:1: field "conversations\[0\]\.value": expected .* within 10000000'):
        read_workload(path)


@pytest.mark.parametrize("command", [["run"], ["search", "--target", "none", "--trials", "2"]])
def test_a_rejected_trace_creates_no_database(tmp_path, capsys, command):
    from kvtune.cli import main
    path = write(tmp_path, "huge.jsonl", jsonl(GOOD, '{"timestamp": 1, "input_length": 1e12, "output_length": 2}'))
    db = tmp_path / "s.db"
    assert main([*command, "--workload", str(path), "--db", f"sqlite:///{db}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'error: {path}:2: field "input_length"'), err
    assert not db.exists() and not list(tmp_path.glob("s.db*"))


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("name, text, line, problem", [
    ("t.jsonl", jsonl(GOOD, nested(5000)), 2, "expected a JSON object, got JSON nested too deeply to read"),
    ("t.jsonl", jsonl(GOOD, GOOD[:-1] + f', "x": {nested(100000)}}}'), 2, "nested too deeply to read"),
    ("t.jsonl", jsonl(nested(5000)), 1, "JSON nested too deeply to read"),  # starts like ShareGPT's array
    ("t.jsonl", jsonl(GOOD[:-1] + f', "x": {nested(5000)}}}'), 1,  # no record to tell the format by
     "not a recognised trace: expected a JSON object, got JSON nested too deeply to read"),
    ("s.json", '[\n{"id": "a", "conversations": []},\n' + nested(5000) + "\n]", 3, "JSON nested too deeply to read"),
])
def test_deeply_nested_json_is_a_bad_record_not_a_crash(tmp_path, name, text, line, problem):
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError) as caught:
        read_workload(path)
    assert str(caught.value).startswith(f"{path}:{line}: ") and problem in str(caught.value)


def test_nesting_the_decoder_just_takes_is_still_reported(tmp_path):
    # Near the recursion limit a value decodes but cannot be encoded again for the message, deeper
    # down the stack; where that window falls depends on the caller's stack, so sweep across it.
    for depth in range(800, 1000, 4):
        record = f'{{"timestamp": 0, "input_length": {nested(depth)}, "output_length": 2}}'
        path = write(tmp_path, "t.jsonl", jsonl(GOOD, record))
        with pytest.raises(TraceError, match=r"t\.jsonl:2: (field \"input_length\": )?expected"):
            read_workload(path)


def test_skip_bad_skips_a_deeply_nested_line(tmp_path):
    path = write(tmp_path, "t.jsonl", jsonl(GOOD, nested(5000), GOOD))
    with pytest.warns(TraceWarning, match=r"skipped 1 bad records \(first: .*t\.jsonl:2: .*nested too deeply"):
        assert len(read_workload(path, skip_bad=True)) == 2


@pytest.mark.parametrize("command", [["trace", "stats"], ["trace", "convert"]])
def test_cli_reports_deep_nesting_and_writes_nothing(tmp_path, capsys, command):
    from kvtune.cli import main
    path = write(tmp_path, "deep.jsonl", jsonl(GOOD, nested(5000)))
    out = tmp_path / "out.jsonl"
    argv = [*command, str(path)] + ([str(out)] if command[1] == "convert" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:2: expected a JSON object, got JSON nested too deeply"), err
    assert "Traceback" not in err and sorted(os.listdir(tmp_path)) == ["deep.jsonl"]
