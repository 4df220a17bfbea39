"""OpenAI-compatible request parsing and response shapes, as vLLM serves them.

Request bodies are validated by pydantic models, as vLLM's are, but strict ones: no
bool for an integer, no string for a number; unknown fields are ignored. A bad
parameter raises APIError(400) with a message naming it (the first bad one: the
prompt or messages, then the sampling fields in order), so the server answers
`{"error": {"message", "type", "param", "code"}}`. Every field is checked against
the range vLLM's request models and SamplingParams accept, so no value a client can
send reaches the engine core and fails there (where one bad request would end every
other).
"""
from __future__ import annotations

import json
import math
import re
import reprlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvengine.core.request import SamplingParams
from kvengine.entrypoints.errors import APIError

# vLLM's request models bound seed by torch.long (`Field(ge=_LONG_INFO.min, le=_LONG_INFO.max)`).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# vLLM bounds neither; a stop list is searched on every token the frontend streams.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


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


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 3, 4, 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 60


def _show(value) -> str:
    """A value for an error message, cut short (its depth too: repr recurses)."""
    return _REPR.repr(value)


def _refuse(message: str) -> PydanticCustomError:
    """A validator's error, its message as written (a ValueError's would gain "Value error, ")."""
    return PydanticCustomError("request", message)


def _finite(value, info: ValidationInfo):
    """A JSON number as a float (a range error then shows -1 as -1.0), refused unless finite:
    json.loads reads NaN and Infinity, and integers too big for a float. Here, not by
    allow_inf_nan, which pydantic checks only after the range."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return value  # the float type refuses it
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _refuse(f"{info.field_name} must be a finite number, got {_show(value)}.")
    return number


Number = Annotated[float, BeforeValidator(_finite)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class ChatMessage(BaseModel):
    """One chat turn; keys besides role and content are left to the chat template."""

    model_config = ConfigDict(strict=True)
    role: str
    content: str


class SamplingRequest(BaseModel):
    """The sampling fields /v1/completions and /v1/chat/completions share, in the order their
    errors take precedence."""

    model_config = ConfigDict(strict=True)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    temperature: Number = Field(1.0, ge=0)
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT64_MAX)  # -1 and 0 both disable it
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: dict | None = None
    logprobs: Any = None
    repetition_penalty: Any = None
    model: str | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, body):
        # null means "not given", but a completion's null max_tokens means all the room left, not 16.
        if not isinstance(body, dict):
            return body
        return {k: v for k, v in body.items() if v is not None or k == "max_tokens"}

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: dict, info: ValidationInfo) -> dict:
        if not info.data.get("stream"):
            raise _refuse("Stream options can only be defined when `stream=True`.")
        return options

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value not in (None, False, 0):
            raise _refuse("logprobs are not supported by kvengine")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, value):
        if value not in (None, 1, 1.0):
            raise _refuse("repetition_penalty other than 1.0 is not supported by kvengine")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, stop):
        return [stop] if isinstance(stop, str) else stop

    @field_validator("stop")
    @classmethod
    def _stop_bounded(cls, stop: list[str]) -> list[str]:
        # Not Field(min_length=1) on each: a constrained str refuses a lone surrogate, a plain one keeps it.
        if not all(stop):
            raise _refuse(_ITEM["stop"])
        if len(stop) > MAX_STOP_STRINGS:
            raise _refuse(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise _refuse(f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters long")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_bounded(cls, stop_ids: list[int]) -> list[int]:
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise _refuse(f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}")
        return stop_ids

    def generation(self, prompts: list, **fields) -> GenerationRequest:
        """The request for the engine; `fields` override what the body gave."""
        options = self.stream_options or {}
        return GenerationRequest(**{
            "model": self.model, "prompts": prompts, "max_tokens": self.max_tokens, "n": self.n,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": max(self.top_k, 0),
            "seed": self.seed, "stop": self.stop, "stop_token_ids": tuple(self.stop_token_ids),
            "ignore_eos": self.ignore_eos, "stream": self.stream,
            "include_usage": bool(options.get("include_usage")),
            "continuous_usage": bool(options.get("continuous_usage_stats")), **fields})


class CompletionRequest(SamplingRequest):
    prompt: str | TokenIds | Annotated[list[str | TokenIds], Field(min_length=1)]
    echo: Any = None
    max_tokens: int | None = Field(16, ge=1)  # the OpenAI and vLLM default for completions

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo):
        if echo:
            raise _refuse("echo is not supported by kvengine")
        return echo

    @property
    def prompts(self) -> list:
        """The prompt as a batch: one text or one list of token ids is a batch of one."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else self.prompt


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)


# A request with several bad fields is answered for the first in this order: its input, then how to sample.
_ORDER = ("prompt", "messages", "echo", *SamplingRequest.model_fields, "max_completion_tokens")
_WHOLE = {  # the message for any error in these fields but their items'
    "prompt": "'prompt' must be a string, a non-empty list of token ids, "
              "or a non-empty list of strings or token-id lists",
    "messages": "'messages' must be a non-empty list of {role, content} objects"}
_ITEM = {  # the message for an error in one of their items
    "messages": "messages[{}] must be an object with string 'role' and 'content'",
    "stop": "'stop' must be a non-empty string or a list of non-empty strings",
    "stop_token_ids": "'stop_token_ids' must be a list of integers"}
_RANGE = {
    "max_tokens": "max_tokens must be at least 1, got {}.",
    "max_completion_tokens": "max_completion_tokens must be at least 1, got {}.",
    "n": "n must be at least 1, got {}.",
    "temperature": "temperature must be non-negative, got {}.",
    "top_p": "top_p must be in (0, 1], got {}.",
    "top_k": f"top_k must be -1 (disable), or at least 1 and at most {INT64_MAX}, got {{}}.",
    "seed": f"seed must be in [{INT64_MIN}, {INT64_MAX}] (a 64-bit integer), got {{}}."}
_WHAT = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
         "string_type": "a string", "dict_type": "an object"}
_WHAT_LIST = {"stop": "a string or a list of strings", "stop_token_ids": "a list of token ids"}


def _message(error: dict) -> str:
    """A pydantic error in the words of vLLM's (and this module's) 400s."""
    key, kind, value = error["loc"][0], error["type"], error["input"]
    if kind == "request":
        return error["msg"]
    if kind == "missing" and key == "prompt":
        return "'prompt' is required: a string, a list of token ids, or a list of either"
    if len(error["loc"]) > 1 and key in _ITEM:
        return _ITEM[key].format(error["loc"][1])
    if key in _WHOLE:
        return _WHOLE[key]
    if kind in ("greater_than", "greater_than_equal", "less_than_equal"):
        return _RANGE[key].format(_show(value))
    what = _WHAT_LIST.get(key) or _WHAT.get(kind, error["msg"])
    return f"'{key}' must be {what}, got {_show(value)}"


Request = TypeVar("Request", bound=SamplingRequest)


def _validate(model: type[Request], body) -> Request:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = min(err.errors(include_url=False), key=lambda e: _ORDER.index(e["loc"][0]))
        raise bad(first["loc"][0], _message(first)) from None


def parse_completion(body) -> GenerationRequest:
    req = _validate(CompletionRequest, body)
    return req.generation(req.prompts)


def parse_chat(body, render=None) -> tuple[GenerationRequest, list[dict]]:
    """render(messages) -> prompt text: the checkpoint's chat template; default render_chat."""
    req = _validate(ChatCompletionRequest, body)
    messages = body["messages"]  # as sent: a template may read keys besides role and content
    try:
        prompt = (render or render_chat)(messages)
    except ValueError as err:  # the template's raise_exception, or a failing template
        raise bad("messages", str(err)) from None
    fields = {}
    if req.max_completion_tokens is not None:  # vLLM: it wins over the deprecated max_tokens
        fields = {"max_tokens": req.max_completion_tokens, "max_tokens_param": "max_completion_tokens"}
    return req.generation([prompt], **fields), messages


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
