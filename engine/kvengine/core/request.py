"""A request as the scheduler and the KV cache manager see it."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# vLLM's finish_reason strings, the `finished_reason` label of vllm:request_success.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1


class PromptTooLongError(ValueError):
    """The prompt cannot be served under max_model_len (vLLM's 400 error)."""


def check_prompt(num_tokens: int, max_len: int) -> None:
    """The input checks vLLM's frontend makes before a request reaches the engine."""
    if num_tokens == 0:
        raise ValueError("The decoder prompt cannot be empty")
    if num_tokens > max_len:
        raise PromptTooLongError(
            f"The decoder prompt (length {num_tokens}) is longer than the maximum model length "
            f"of {max_len}. Make sure that `max_model_len` is no smaller than the number "
            "of text tokens.")
    if num_tokens == max_len:
        raise PromptTooLongError(
            f"The decoder prompt (length {num_tokens}) plus the number of requested output "
            f"tokens (at least 1) is longer than the maximum model length of {max_len}. Make "
            "sure that `max_model_len` is no smaller than the number of text tokens (prompt + "
            "requested output tokens).")


class Request:
    """Token state plus the timestamps vLLM derives its latency metrics from.

    A plain class with slots: the scheduler touches these fields for every
    running request on every step.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "all_token_ids", "num_prompt_tokens",
        "sampling_params", "max_tokens", "eos_token_id", "cache_salt", "status",
        "num_computed_tokens", "num_cached_tokens", "num_preemptions", "block_hashes",
        "arrival_time", "first_scheduled_time", "first_token_time", "token_times",
        "finish_time", "stop_reason",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, arrival_time: float = 0.0,
                 eos_token_id: int | None = None, cache_salt: str | None = None):
        sp = sampling_params or SamplingParams()
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sp
        self.max_tokens = sp.max_tokens
        self.eos_token_id = None if sp.ignore_eos else eos_token_id
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first scheduling
        self.num_preemptions = 0
        self.block_hashes: list = []  # hashes of full blocks, filled lazily
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None
        self.stop_reason: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
