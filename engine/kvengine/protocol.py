"""OpenAI-compatible request parsing and response shapes, as vLLM serves them.

Bad parameters raise APIError(400) with a message naming the parameter, so the
server answers `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .request import SamplingParams

ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError",
               409: "ConflictError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

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


def _typed(body: dict, key: str, kinds, default, what: str):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise bad(key, f"'{key}' must be {what}, got {value!r}")
    if not isinstance(value, kinds):
        raise bad(key, f"'{key}' must be {what}, got {value!r}")
    return value


def _sampling_fields(body: dict) -> dict:
    max_tokens = _typed(body, "max_tokens", (int,), None, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_tokens", f"max_tokens must be at least 1, got {max_tokens}.")
    n = _typed(body, "n", (int,), 1, "an integer")
    if n < 1:
        raise bad("n", f"n must be at least 1, got {n}.")
    temperature = float(_typed(body, "temperature", (int, float), 1.0, "a number"))
    if temperature < 0:
        raise bad("temperature", f"temperature must be non-negative, got {temperature}.")
    top_p = float(_typed(body, "top_p", (int, float), 1.0, "a number"))
    if not 0 < top_p <= 1:
        raise bad("top_p", f"top_p must be in (0, 1], got {top_p}.")
    top_k = _typed(body, "top_k", (int,), 0, "an integer")
    if top_k < -1:
        raise bad("top_k", f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    stop = _typed(body, "stop", (str, list), [], "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", "'stop' must be a non-empty string or a list of non-empty strings")
    stop_ids = _typed(body, "stop_token_ids", (list,), [], "a list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise bad("stop_token_ids", "'stop_token_ids' must be a list of integers")
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
                top_k=max(top_k, 0), seed=_typed(body, "seed", (int,), None, "an integer"),
                stop=stop, stop_token_ids=tuple(stop_ids),
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
    completion_tokens = _typed(body, "max_completion_tokens", (int,), None, "an integer")
    if completion_tokens is not None:  # vLLM: it wins over the deprecated max_tokens
        if completion_tokens < 1:
            raise bad("max_completion_tokens", f"max_completion_tokens must be at least 1, got {completion_tokens}.")
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
