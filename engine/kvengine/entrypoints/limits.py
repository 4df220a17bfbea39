"""vLLM's API-layer length rules (what a request may ask for under max_model_len), and
the bounds a server puts on one request and on the requests in flight.

As vLLM 0.32 answers (measured on its CPU build, `vllm/renderers/params.py` and
`get_max_tokens`): max_tokens above max_model_len and a prompt longer than
max_model_len are 400s; a prompt plus max_tokens over the limit is not, max_tokens
is clamped to the room left; an unset max_tokens (chat) gets all that room.
Messages end as vLLM's VLLMValidationError prints them.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvengine.entrypoints.errors import APIError


def _invalid(message: str, param: str, value) -> APIError:
    return APIError(400, f"{message} (parameter={param}, value={value})", param)


def check_max_tokens(max_tokens: int | None, max_model_len: int, param: str = "max_tokens") -> None:
    """Before tokenizing: no prompt leaves room for more than max_model_len tokens."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise _invalid(f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                       "Please request fewer output tokens.", param, max_tokens)


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens > max_model_len:
        raise _invalid(f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt contains {num_tokens} input tokens, which exceeds this limit even without "
                       "any output tokens. Please reduce the length of the input prompt.",
                       "input_tokens", num_tokens)


def clamp_max_tokens(num_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The max_tokens the engine gets: the room left after the prompt, or less if asked."""
    room = max_model_len - num_tokens
    allowed = room if max_tokens is None else min(max_tokens, room)
    if allowed < 1:  # the prompt fills the context: not one token fits
        raise _invalid(f"max_tokens must be at least 1, got {allowed}.", "max_tokens", allowed)
    return allowed


# What one request may ask of the frontend, beyond vLLM's length rules. vLLM caps n
# with VLLM_MAX_N_SEQUENCES (16384) and, with --max-num-queued-reqs, the requests in
# flight; it bounds neither by default. A server that must survive any client needs
# both, so kvengine defaults to bounds no real workload reaches.
MAX_N_SEQUENCES = 128
MAX_NUM_QUEUED_REQS = 4096
MAX_REQUEST_BODY_BYTES = 32 << 20
REQUEST_READ_TIMEOUT_S = 30.0
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServerLimits:
    max_n_sequences: int = MAX_N_SEQUENCES
    max_num_queued_reqs: int = MAX_NUM_QUEUED_REQS  # 0: unbounded
    max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES


def check_n(n: int, limits: ServerLimits) -> None:
    if n > limits.max_n_sequences:  # vLLM's SamplingParams message
        raise APIError(400, f"n must be at most {limits.max_n_sequences}, got {n}.", "n")


def check_capacity(needed: int, unfinished: int, limits: ServerLimits, n: int) -> None:
    """`needed` engine requests (prompts x n) may join `unfinished` ones, as vLLM's
    --max-num-queued-reqs counts them: a 400 if they never could, a 503 while full."""
    cap = limits.max_num_queued_reqs
    if not cap:
        return
    if needed > cap:
        raise APIError(400, f"the request asks for {needed} sequences (prompts x n={n}), more than "
                            f"--max-num-queued-reqs={cap} allows", "n" if n > 1 else "prompt")
    if unfinished + needed > cap:
        raise APIError(503, f"the server is at capacity: {unfinished} requests in flight, "
                            f"--max-num-queued-reqs={cap}; retry later",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
