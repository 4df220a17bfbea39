"""The request models' decisions, called directly: what a body is refused for (and which
field the 400 names), the defaults, and which of two fields wins."""
import pytest
from kvengine.entrypoints.protocol import APIError, parse_chat, parse_completion

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
CHAT = [{"role": "user", "content": "hi"}]


def refused(parse, body) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.body()["error"]["type"] == "BadRequestError"
    return info.value


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", True, "'max_tokens' must be an integer, got True"),
    ("max_tokens", 2.0, "'max_tokens' must be an integer, got 2.0"),
    ("max_tokens", "4", "'max_tokens' must be an integer, got '4'"),
    ("n", False, "'n' must be an integer, got False"),
    ("seed", 1.5, "'seed' must be an integer, got 1.5"),
    ("top_k", "5", "'top_k' must be an integer, got '5'"),
    ("temperature", "0.5", "'temperature' must be a number, got '0.5'"),
    ("top_p", True, "'top_p' must be a number, got True"),
    ("stream", 1, "'stream' must be a boolean, got 1"),
    ("ignore_eos", "yes", "'ignore_eos' must be a boolean, got 'yes'"),
    ("model", 7, "'model' must be a string, got 7"),
    ("stream_options", [], "'stream_options' must be an object, got []"),
    ("stop", 3, "'stop' must be a string or a list of strings, got 3"),
    ("stop", ["a", 1], "'stop' must be a non-empty string or a list of non-empty strings"),
    ("stop", "", "'stop' must be a non-empty string or a list of non-empty strings"),
    ("stop_token_ids", 5, "'stop_token_ids' must be a list of token ids, got 5"),
    ("stop_token_ids", [1, True], "'stop_token_ids' must be a list of integers"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(field, value, message):
    for parse, body in ((parse_completion, {"prompt": "x"}), (parse_chat, {"messages": CHAT})):
        err = refused(parse, {**body, field: value})
        assert (err.param, err.message) == (field, message)


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "max_tokens must be at least 1, got 0."),
    ("n", 0, "n must be at least 1, got 0."),
    ("temperature", -1, "temperature must be non-negative, got -1.0."),
    ("temperature", float("nan"), "temperature must be a finite number, got nan."),
    ("temperature", 10 ** 400, "temperature must be a finite number, got 1" + "0" * 27 + "..." + "0" * 29 + "."),
    ("top_p", 0, "top_p must be in (0, 1], got 0.0."),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5."),
    ("top_p", float("-inf"), "top_p must be a finite number, got -inf."),
    ("top_k", -2, f"top_k must be -1 (disable), or at least 1 and at most {INT64_MAX}, got -2."),
    ("top_k", INT64_MAX + 1, f"top_k must be -1 (disable), or at least 1 and at most {INT64_MAX}, got {1 << 63}."),
    ("seed", INT64_MIN - 1, f"seed must be in [{INT64_MIN}, {INT64_MAX}] (a 64-bit integer), got {INT64_MIN - 1}."),
    ("stop", ["s"] * 129, "'stop' may hold at most 128 strings, got 129"),
    ("stop", ["s" * 1025], "each stop string may be at most 1024 characters long"),
    ("stop_token_ids", [0] * 1025, "'stop_token_ids' may hold at most 1024 ids, got 1025"),
    ("stream_options", {"include_usage": True}, "Stream options can only be defined when `stream=True`."),
    ("logprobs", 1, "logprobs are not supported by kvengine"),
    ("repetition_penalty", 1.1, "repetition_penalty other than 1.0 is not supported by kvengine"),
])
def test_a_value_out_of_range_is_refused_naming_its_field(field, value, message):
    for parse, body in ((parse_completion, {"prompt": "x"}), (parse_chat, {"messages": CHAT})):
        err = refused(parse, {**body, field: value})
        assert (err.param, err.message) == (field, message)


def test_the_edges_of_the_ranges_are_taken_and_an_integer_is_a_number():
    req = parse_completion({"prompt": "x", "n": 1, "top_k": INT64_MAX, "seed": INT64_MIN, "temperature": 0,
                            "top_p": 5e-324, "logprobs": 0, "repetition_penalty": 1})
    assert (req.n, req.top_k, req.seed, req.top_p) == (1, INT64_MAX, INT64_MIN, 5e-324)
    assert req.temperature == 0.0 and type(req.temperature) is float
    assert type(parse_completion({"prompt": "x", "top_p": 1}).top_p) is float
    assert parse_completion({"prompt": "x", "top_k": -1}).top_k == 0  # -1 and 0 both disable it


def test_the_defaults():
    req = parse_completion({"prompt": "x"})
    assert req.max_tokens == 16 and req.max_tokens_param == "max_tokens"  # OpenAI's and vLLM's for completions
    assert (req.model, req.n, req.temperature, req.top_p, req.top_k, req.seed) == (None, 1, 1.0, 1.0, 0, None)
    assert (req.stop, req.stop_token_ids) == ([], ())
    assert not (req.ignore_eos or req.stream or req.include_usage or req.continuous_usage)
    assert parse_completion({"prompt": "x", "max_tokens": None}).max_tokens is None  # all the room left
    nulls = {k: None for k in ("n", "temperature", "top_p", "top_k", "stop", "stream", "stream_options", "logprobs")}
    assert parse_completion({"prompt": "x", **nulls}) == req  # null is "not given"
    chat, messages = parse_chat({"messages": CHAT})
    assert chat.max_tokens is None and chat.prompts == ["<|user|>\nhi\n<|assistant|>\n"] and messages == CHAT


def test_max_completion_tokens_wins_over_max_tokens():
    req, _ = parse_chat({"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 5})
    assert (req.max_tokens, req.max_tokens_param) == (5, "max_completion_tokens")
    req, _ = parse_chat({"messages": CHAT, "max_tokens": 3, "max_completion_tokens": None})
    assert (req.max_tokens, req.max_tokens_param) == (3, "max_tokens")
    for value in (0, True, "5"):
        assert refused(parse_chat, {"messages": CHAT, "max_completion_tokens": value}).param == "max_completion_tokens"


def test_unknown_fields_are_ignored():
    extra = {"user": "u", "frequency_penalty": "junk", "tools": [{"x": None}], "best_of": True}
    assert parse_completion({"prompt": "x", **extra}) == parse_completion({"prompt": "x"})
    assert parse_chat({"messages": CHAT, **extra}) == parse_chat({"messages": CHAT})


def test_prompt_shapes():
    assert parse_completion({"prompt": "x"}).prompts == ["x"]
    assert parse_completion({"prompt": [1, 2]}).prompts == [[1, 2]]
    assert parse_completion({"prompt": ["a", [3]]}).prompts == ["a", [3]]
    assert refused(parse_completion, {}).message.startswith("'prompt' is required")
    for prompt in (None, 42, [], [[]], [1, "a"], [True], {"text": "x"}):
        assert refused(parse_completion, {"prompt": prompt}).param == "prompt"


def test_messages_shapes():
    with_name = [{"role": "user", "content": "hi", "name": "ann"}]
    seen = []
    _, messages = parse_chat({"messages": with_name}, render=lambda m: seen.append(m) or "p")
    assert messages is seen[0] == with_name  # as sent: a template may read keys besides role and content
    for body in ({}, {"messages": []}, {"messages": "hi"}):
        err = refused(parse_chat, body)
        assert err.param == "messages"
        assert err.message == "'messages' must be a non-empty list of {role, content} objects"
    err = refused(parse_chat, {"messages": [*CHAT, {"role": "user", "content": 5}]})
    assert (err.param, err.message) == ("messages", "messages[1] must be an object with string 'role' and 'content'")

    def fails(_):
        raise ValueError("roles must alternate")
    err = refused(lambda body: parse_chat(body, render=fails), {"messages": CHAT})
    assert (err.param, err.message) == ("messages", "roles must alternate")


def test_the_first_bad_field_is_named_the_input_first():
    assert refused(parse_completion, {"prompt": 5, "n": 0}).param == "prompt"
    assert refused(parse_completion, {"prompt": "x", "echo": True, "n": 0}).param == "echo"
    assert refused(parse_chat, {"messages": [], "n": 0}).param == "messages"
    assert refused(parse_completion, {"prompt": "x", "ignore_eos": 1, "n": 0, "temperature": -1}).param == "n"
    assert refused(parse_chat, {"messages": CHAT, "max_completion_tokens": 0, "ignore_eos": 1}).param == "ignore_eos"
    body = {"prompt": "x", "logprobs": 1, "stream_options": {}}  # stream_options is checked before logprobs
    assert refused(parse_completion, body).param == "stream_options"


def test_streaming_options_and_a_body_that_is_not_an_object():
    req = parse_completion({"prompt": "x", "stream": True, "stream_options": {"include_usage": True,
                                                                            "continuous_usage_stats": True}})
    assert req.stream and req.include_usage and req.continuous_usage
    assert parse_completion({"prompt": "x", "stop": "end"}).stop == ["end"]
    for parse in (parse_completion, parse_chat):
        for body in ([], "x", None, 3):
            err = refused(parse, body)
            assert (err.param, err.message) == (None, "the request body must be a JSON object")
