"""Each trace reader on small files of its format, auto-detection, the real Azure
traces, and read -> write kvtune JSONL -> read round trips."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtune.workload import (
    TraceRequest,
    TraceWarning,
    Workload,
    count_tokens,
    read_workload,
    workload_prompt_token_ids,
    write_workload,
)

from tracepaths import TRACES

# Tests that are about a warning catch it with pytest.warns; elsewhere it is noise.
pytestmark = pytest.mark.filterwarnings("ignore::kvtune.workload.TraceWarning")

KVTUNE = "\n".join(json.dumps(r) for r in [
    {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]},
    {"timestamp": 1500.5, "input_length": 512, "output_length": 7, "hash_ids": [1],
     "prompt": "hi", "session_id": "s1"},
    {"timestamp": 2000, "input_length": 3, "output_length": 1},
]) + "\n"

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.0000000,110,27
"""

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
"""

BURSTGPT_SESSIONS = """Timestamp,Session ID,Model,Request tokens,Response tokens,Total tokens,Log Type,Elapsed time
0.5,abc,ChatGPT,100,20,120,Conversation log,1.2
1.5,,ChatGPT,200,30,230,API log,2.0
"""

SHAREGPT = [
    {"id": "c1", "conversations": [
        {"from": "human", "value": "Hello"},
        {"from": "gpt", "value": "Hi there!"},
        {"from": "human", "value": "Tell me a joke"},
        {"from": "gpt", "value": "No."},
    ]},
    {"id": "c2", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "héllo"},
        {"from": "gpt", "value": "ok"},
        {"from": "human", "value": "unanswered"},
    ]},
]

VLLM_CUSTOM = '{"prompt": "What is 2+2?", "output_tokens": 5}\n{"prompt": "Dîs", "output_tokens": 9}\n'


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_kvtune_jsonl_fields_and_millisecond_timestamps(tmp_path):
    w = read_workload(write(tmp_path, "t.jsonl", KVTUNE))
    assert len(w) == 3 and w.hash_block_size == 512
    first, second, third = w.requests
    assert first == TraceRequest(0.0, 600, 20, (1, 2))
    assert second.arrival_s == pytest.approx(1.5005)
    assert (second.prompt, second.session_id, second.hash_ids) == ("hi", "s1", (1,))
    assert third.hash_ids is None
    assert w.duration_s == pytest.approx(2.0)


def test_mooncake_is_the_kvtune_reader(tmp_path):
    path = write(tmp_path, "m.jsonl", KVTUNE)
    assert read_workload(path, "mooncake").requests == read_workload(path, "kvtune").requests


def test_azure_arrivals_are_exact_offsets_from_the_first_row(tmp_path):
    w = read_workload(write(tmp_path, "a.csv", AZURE))
    assert [r.arrival_s for r in w] == [0.0, 0.052, 1.02004]
    assert [(r.input_length, r.output_length) for r in w] == [(4808, 10), (3180, 8), (110, 27)]


def test_azure_2024_timestamps_with_utc_offset(tmp_path):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n" \
           "2024-05-10 00:00:00.009930+00:00,100,10\n2024-05-10 02:00:01.5+02:00,50,5\n"
    w = read_workload(write(tmp_path, "a24.csv", text))
    assert [r.arrival_s for r in w] == [0.0, pytest.approx(1.49007)]


def test_burstgpt_skips_failed_rows_and_counts_them(tmp_path):
    with pytest.warns(TraceWarning, match="left out 1 failed requests"):
        w = read_workload(write(tmp_path, "b.csv", BURSTGPT))
    assert w.failed == 1
    assert [(r.arrival_s, r.input_length, r.output_length) for r in w] == [(5, 472, 18), (118, 417, 276)]


def test_burstgpt_newer_release_with_sessions(tmp_path):
    w = read_workload(write(tmp_path, "b2.csv", BURSTGPT_SESSIONS))
    assert [r.session_id for r in w] == ["abc", None]
    assert [r.input_length for r in w] == [100, 200]


def test_sharegpt_turns_carry_the_conversation_so_far(tmp_path):
    with pytest.warns(TraceWarning, match="left out 1 human turns without a reply"):
        w = read_workload(write(tmp_path, "s.json", json.dumps(SHAREGPT, indent=1)))
    assert len(w) == 3 and w.failed == 1
    first, second, third = w.requests
    assert first.prompt == "Hello" and (first.input_length, first.output_length) == (5, 9)
    assert second.prompt == "\n".join(turn["value"] for turn in SHAREGPT[0]["conversations"][:3])  # the turns so far
    assert second.input_length == count_tokens(second.prompt) and second.output_length == 3
    assert third.prompt == "Be brief.\nhéllo" and third.input_length == 16
    assert [r.session_id for r in w] == ["c1", "c1", "c2"]
    assert all(r.arrival_s == 0.0 for r in w)


def test_untimed_formats_take_a_rate(tmp_path):
    path = write(tmp_path, "s.json", json.dumps(SHAREGPT))
    w = read_workload(path, rate=2.0, burstiness=float("inf"))
    assert [r.arrival_s for r in w] == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="retime"):
        read_workload(write(tmp_path, "a.csv", AZURE), rate=2.0)


def test_vllm_custom(tmp_path):
    w = read_workload(write(tmp_path, "c.jsonl", VLLM_CUSTOM))
    assert [(r.input_length, r.output_length, r.prompt) for r in w] == [
        (12, 5, "What is 2+2?"), (4, 9, "Dîs")]


@pytest.mark.parametrize("text, expected", [
    (KVTUNE, "kvtune"), (AZURE, "azure"), (BURSTGPT_SESSIONS, "burstgpt"),
    (json.dumps(SHAREGPT), "sharegpt"), (VLLM_CUSTOM, "vllm-custom"),
])
def test_format_is_told_from_content_not_the_name(tmp_path, text, expected):
    from kvtune.workload import detect_format

    path = write(tmp_path, "trace.txt", text)
    assert detect_format(path.read_text(), str(path)) == expected
    assert len(read_workload(path)) >= 2


def test_crlf_line_endings(tmp_path):
    path = tmp_path / "crlf.csv"
    path.write_bytes(AZURE.replace("\n", "\r\n").encode())
    assert len(read_workload(path)) == 3
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(KVTUNE.replace("\n", "\r\n").encode())
    assert len(read_workload(path)) == 3


def test_out_of_order_timestamps_are_sorted_with_a_warning(tmp_path):
    lines = [{"timestamp": t, "input_length": 1, "output_length": 1} for t in (0, 30, 10, 20, 40)]
    path = write(tmp_path, "o.jsonl", "\n".join(json.dumps(r) for r in lines))
    with pytest.warns(TraceWarning, match="1 requests arrived earlier"):
        w = read_workload(path)
    assert [r.arrival_s for r in w] == [0.0, 0.01, 0.02, 0.03, 0.04]


@pytest.mark.parametrize("name, count", [("AzureLLMInferenceTrace_code.csv", 8819),
                                         ("AzureLLMInferenceTrace_conv.csv", 19366)])
def test_real_azure_traces_read_completely(name, count):
    w = read_workload(TRACES / name)
    assert len(w) == count and w.skipped == 0 and w.failed == 0
    assert 3000 < w.duration_s < 3900  # about an hour
    assert w.requests[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w.requests, w.requests[1:]))


def assert_same_requests(a: Workload, b: Workload) -> None:
    assert len(a) == len(b)
    for x, y in zip(a.requests, b.requests):
        assert x.arrival_s == pytest.approx(y.arrival_s, abs=1e-9)
        assert (x.input_length, x.output_length, x.hash_ids, x.prompt, x.session_id) == \
               (y.input_length, y.output_length, y.hash_ids, y.prompt, y.session_id)


@pytest.mark.parametrize("name, text", [
    ("k.jsonl", KVTUNE), ("a.csv", AZURE), ("b.csv", BURSTGPT_SESSIONS),
    ("s.json", json.dumps(SHAREGPT)), ("c.jsonl", VLLM_CUSTOM),
])
def test_round_trip_through_kvtune_jsonl(tmp_path, name, text):
    original = read_workload(write(tmp_path, name, text))
    out = tmp_path / "out.jsonl"
    write_workload(original, out)
    again = read_workload(out, "kvtune")
    assert_same_requests(original, again)
    write_workload(again, out)
    assert_same_requests(again, read_workload(out))


def test_round_trip_keeps_a_fine_hash_block_size(tmp_path):
    w = Workload([TraceRequest(0.25, 40, 3, (7, 8, 9)), TraceRequest(1.0, 16, 2, (7,))], hash_block_size=16)
    path = tmp_path / "fine.jsonl"
    write_workload(w, path)
    again = read_workload(path)
    assert again.hash_block_size == 16
    assert_same_requests(w, again)


def test_round_trip_keeps_the_block_size_behind_requests_without_hash_ids(tmp_path):
    # only records with hash ids state their block size: the first such record sets the trace's
    w = Workload([TraceRequest(0.0, 30, 2), TraceRequest(0.5, 60, 3, (7, 8, 9))], hash_block_size=26)
    path = tmp_path / "scaled.jsonl"
    write_workload(w, path)
    again = read_workload(path)
    assert again.hash_block_size == 26
    assert_same_requests(w, again)


def test_round_trip_keeps_exact_prompt_tokens(tmp_path):
    """A workload built with its tokens (a shared system prompt, say) replays live with those
    very tokens: the live run reads it back from the JSONL the sim's copy never went through."""
    shared = tuple(range(1000, 1048))
    w = Workload([TraceRequest(0.0, 50, 4, prompt_token_ids=shared + (7, 8)),
                  TraceRequest(0.5, 49, 4, prompt_token_ids=shared + (9,)), TraceRequest(1.0, 30, 2)])
    path = tmp_path / "tokens.jsonl"
    write_workload(w, path)
    again = read_workload(path)
    assert again.requests == w.requests
    assert list(workload_prompt_token_ids(again))[:2] == [list(shared + (7, 8)), list(shared + (9,))]


def test_round_trip_of_unusual_text(tmp_path):
    prompt = "line\u2028sep \"quoted\" \\ tab\t ünï 😀"
    w = Workload([TraceRequest(0.0, count_tokens(prompt), 3, prompt=prompt, session_id="é")])
    path = tmp_path / "u.jsonl"
    write_workload(w, path)
    assert read_workload(path).requests == w.requests


def test_real_trace_round_trip(tmp_path):
    w = read_workload(TRACES / "AzureLLMInferenceTrace_code.csv")
    out = tmp_path / "code.jsonl"
    write_workload(w, out)
    assert_same_requests(w, read_workload(out))


def test_write_is_atomic_and_leaves_no_temporary_files(tmp_path):
    out = tmp_path / "w.jsonl"
    out.write_text("old contents\n")
    broken = Workload([TraceRequest(0.0, 5, 1), object()])  # the second record cannot be written
    with pytest.raises(AttributeError):
        write_workload(broken, out)
    assert out.read_text() == "old contents\n"
    assert os.listdir(tmp_path) == ["w.jsonl"]
    write_workload(Workload([TraceRequest(0.0, 5, 1)]), out)
    assert os.listdir(tmp_path) == ["w.jsonl"]
    assert json.loads(out.read_text()) == {"timestamp": 0.0, "input_length": 5, "output_length": 1}
