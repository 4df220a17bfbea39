"""vLLM's API-layer length rules: what a request may ask for under max_model_len.

As vLLM 0.32 answers (measured on its CPU build, `vllm/renderers/params.py` and
`get_max_tokens`): max_tokens above max_model_len and a prompt longer than
max_model_len are 400s; a prompt plus max_tokens over the limit is not, max_tokens
is clamped to the room left; an unset max_tokens (chat) gets all that room.
Messages end as vLLM's VLLMValidationError prints them.
"""
from __future__ import annotations

from .protocol import APIError


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
