"""OpenAI-compatible request parsing and response shapes, as vLLM serves them.

Bad parameters raise APIError(400) with a message naming the parameter, so the
server answers `{"error": {"message", "type", "param", "code"}}`. Every field is
checked against the range vLLM's request models and SamplingParams accept, so no
value a client can send reaches the engine core and fails there (where one bad
request would end every other).
"""
from __future__ import annotations

import json
import math
import re
import reprlib
import time
import uuid
from dataclasses import dataclass, field

from kvengine.core.request import SamplingParams

ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 409: "ConflictError",
               413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
# vLLM's request models bound seed by torch.long (`Field(ge=_LONG_INFO.min, le=_LONG_INFO.max)`).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# vLLM bounds neither; a stop list is searched on every token the frontend streams.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param)


@dataclass
class GenerationRequest:
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None
    prompts: list  # each a str or a list of token ids
    max_tokens: int | None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from, for error messages

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=seed, ignore_eos=self.ignore_eos,
                              stop_token_ids=self.stop_token_ids, n=self.n)


def parse_json(raw: bytes):
    """The request body as JSON: a 400 for anything Python's parser refuses (bad syntax or
    UTF-8, nesting past its recursion limit, an integer of more than 4300 digits) and for
    a string holding a lone surrogate, which no UTF-8 answer (or tokenizer) can carry."""
    try:
        body = json.loads(raw)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, the int digits limit
        raise bad(None, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise bad(None, "the request body is not valid JSON: it is nested too deeply") from None
    where = _lone_surrogate(body)
    if where is not None:
        raise bad(where or None, f"'{where or 'the request body'}' holds a lone surrogate: not valid Unicode")
    return body


def _lone_surrogate(value) -> str | None:
    """The top-level field of the first string (or key) with a lone surrogate; "" for the body
    itself; None if there is none. A stack, not recursion: the body may be nested deeply."""
    stack = [("", value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                return where
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((where or k, k))
                stack.append((where or k, item))
        elif isinstance(v, list):
            stack.extend((where, item) for item in v)
    return None


def _typed(body: dict, key: str, kinds, default, what: str):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise bad(key, f"'{key}' must be {what}, got {_show(value)}")
    if not isinstance(value, kinds):
        raise bad(key, f"'{key}' must be {what}, got {_show(value)}")
    return value


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 3, 4, 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 60


def _show(value) -> str:
    """A value for an error message, cut short (its depth too: repr recurses)."""
    return _REPR.repr(value)


def _integer(body: dict, key: str, default, low: int | None = None, high: int | None = None,
             message: str | None = None):
    value = _typed(body, key, (int,), default, "an integer")
    if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
        raise bad(key, (message or f"{key} must be in [{low}, {high}], got {{}}.").format(_show(value)))
    return value


def _number(body: dict, key: str, default: float) -> float:
    """A finite float: json.loads reads NaN and Infinity, and an integer too big for a float."""
    value = _typed(body, key, (int, float), default, "a number")
    try:
        value = float(value)
    except OverflowError:
        raise bad(key, f"{key} must be a finite number, got {_show(value)}.") from None
    if not math.isfinite(value):
        raise bad(key, f"{key} must be a finite number, got {value}.")
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = _typed(body, "stop", (str, list), [], "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "'stop' must be a non-empty string or a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise bad("stop", f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters long")
    return stop


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    stop_ids = _typed(body, "stop_token_ids", (list,), [], "a list of token ids")
    if not _is_token_list(stop_ids):
        raise bad("stop_token_ids", "'stop_token_ids' must be a list of integers")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                                    f"got {len(stop_ids)}")
    return tuple(stop_ids)


def _sampling_fields(body: dict) -> dict:
    max_tokens = _integer(body, "max_tokens", None, 1, message="max_tokens must be at least 1, got {}.")
    n = _integer(body, "n", 1, 1, message="n must be at least 1, got {}.")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise bad("temperature", f"temperature must be non-negative, got {temperature}.")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"top_p must be in (0, 1], got {top_p}.")
    top_k = _integer(body, "top_k", 0, -1, INT64_MAX,
                     f"top_k must be -1 (disable), or at least 1 and at most {INT64_MAX}, got {{}}.")
    seed = _integer(body, "seed", None, INT64_MIN, INT64_MAX,
                    f"seed must be in [{INT64_MIN}, {INT64_MAX}] (a 64-bit integer), got {{}}.")
    stream = _typed(body, "stream", (bool,), False, "a boolean")
    options = _typed(body, "stream_options", (dict,), None, "an object")
    if options is not None and not stream:
        raise bad("stream_options", "Stream options can only be defined when `stream=True`.")
    options = options or {}
    if body.get("logprobs") not in (None, False, 0):
        raise bad("logprobs", "logprobs are not supported by kvengine")
    rep = body.get("repetition_penalty", 1.0)
    if rep not in (None, 1, 1.0):
        raise bad("repetition_penalty", "repetition_penalty other than 1.0 is not supported by kvengine")
    model = _typed(body, "model", (str,), None, "a string")
    return dict(model=model, max_tokens=max_tokens, n=n, temperature=temperature, top_p=top_p,
                top_k=max(top_k, 0), seed=seed, stop=_stop_strings(body), stop_token_ids=_stop_token_ids(body),
                ignore_eos=_typed(body, "ignore_eos", (bool,), False, "a boolean"),
                stream=stream, include_usage=bool(options.get("include_usage")),
                continuous_usage=bool(options.get("continuous_usage_stats")))


def _is_token_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_completion(body) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "'prompt' is required: a string, a list of token ids, or a list of either")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (_is_token_list(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (_is_token_list(p) and p) for p in prompt):
        prompts = prompt
    else:
        raise bad("prompt", "'prompt' must be a string, a non-empty list of token ids, "
                            "or a non-empty list of strings or token-id lists")
    if body.get("echo"):
        raise bad("echo", "echo is not supported by kvengine")
    fields = _sampling_fields(body)
    if fields["max_tokens"] is None and "max_tokens" not in body:
        fields["max_tokens"] = 16  # the OpenAI and vLLM default for completions
    return GenerationRequest(prompts=prompts, **fields)


def parse_chat(body, render=None) -> tuple[GenerationRequest, list[dict]]:
    """render(messages) -> prompt text: the checkpoint's chat template; default render_chat."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise bad("messages", f"messages[{i}] must be an object with string 'role' and 'content'")
    fields = _sampling_fields(body)
    completion_tokens = _integer(body, "max_completion_tokens", None, 1,
                                 message="max_completion_tokens must be at least 1, got {}.")
    if completion_tokens is not None:  # vLLM: it wins over the deprecated max_tokens
        fields.update(max_tokens=completion_tokens, max_tokens_param="max_completion_tokens")
    try:
        prompt = (render or render_chat)(messages)
    except ValueError as err:  # the template's raise_exception, or a failing template
        raise bad("messages", str(err)) from None
    return GenerationRequest(prompts=[prompt], **fields), messages


def render_chat(messages: list[dict]) -> str:
    """A plain chat template: each turn as `<|role|>` and its text, then the assistant's cue."""
    turns = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(turns) + "<|assistant|>\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
