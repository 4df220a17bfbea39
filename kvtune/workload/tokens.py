"""Prompt token ids for trace requests, and the bundled byte-level tokenizer.

Traces rarely carry prompts, only their prefix structure (`hash_ids`). To make
a server's prefix cache see that structure, every hash id is turned into a
fixed pseudo-random block of token ids, seeded by the id alone: two requests
with the same leading ids send the same leading tokens, to any server. Token
`p` of hash id `h` is `f(h, p)`, so a partial last block is a prefix of the
full block with the same id.

Token ids lie in [1000, 30000). Every common tokenizer accepts them: it sits
inside Llama-2's and Mistral's 32,000-entry vocabularies (the smallest in
common use; Llama-3, Qwen and GPT-style vocabularies are larger), clear of the
special tokens (<s>, </s>, <unk>, chat markers) and of the byte-fallback tokens
that occupy the lowest ids.

Where the tokens come from, first match wins:

1. the request's explicit `prompt_token_ids`;
2. its `hash_ids`;
3. its `prompt` text, byte-tokenized, when that agrees with `input_length`
   (the text was counted by the bundled tokenizer, so its tokens are honest);
4. otherwise a stream seeded by a per-request key: unique to the request, so
   it shares nothing with any other request. Give each request of a workload
   its index as `unique_key` (`workload_prompt_token_ids` does this); without
   one, the key is a digest of the request's fields.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

from .model import DEFAULT_HASH_BLOCK_SIZE, TraceRequest, Workload

TOKEN_ID_MIN = 1000
TOKEN_ID_MAX = 30000  # exclusive
_TOKEN_SPAN = np.uint64(TOKEN_ID_MAX - TOKEN_ID_MIN)

# Distinct salts keep hash-id blocks and per-request streams apart.
_HASH_SALT = np.uint64(0x6A09E667F3BCC908)
_UNIQUE_SALT = np.uint64(0xBB67AE8584CAA73B)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = (np.uint64(s) for s in (30, 27, 31, 32))


def utf8(text: str) -> bytes:
    """`text` as UTF-8; lone surrogates (valid in JSON strings) pass through as bytes."""
    return text.encode("utf-8", errors="surrogatepass")


def count_tokens(text: str) -> int:
    """Tokens in `text` under the bundled byte-level tokenizer: its UTF-8 bytes."""
    return len(utf8(text))


def byte_token_ids(text: str) -> np.ndarray:
    """The bundled tokenizer's ids for `text`: TOKEN_ID_MIN + each UTF-8 byte."""
    raw = np.frombuffer(utf8(text), dtype=np.uint8)
    return raw.astype(np.uint64) + np.uint64(TOKEN_ID_MIN)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function over a uint64 array (wrapping arithmetic)."""
    x = x + _GOLDEN
    x ^= x >> _S30
    x *= _MUL1
    x ^= x >> _S27
    x *= _MUL2
    x ^= x >> _S31
    return x


def _to_token_range(mixed: np.ndarray) -> np.ndarray:
    # Multiply-shift maps the top 32 bits onto the range without a slow modulo.
    return ((mixed >> _S32) * _TOKEN_SPAN >> _S32) + np.uint64(TOKEN_ID_MIN)


_positions_cache = np.arange(0, dtype=np.uint64)


def _positions(n: int) -> np.ndarray:
    global _positions_cache
    if len(_positions_cache) < n:
        _positions_cache = np.arange(max(n, 2 * len(_positions_cache)), dtype=np.uint64)
    return _positions_cache[:n]


def tokens_of_hash_blocks(hash_ids, input_length: int, hash_block_size: int) -> np.ndarray:
    """Tokens for a prompt made of `hash_ids` blocks, cut to `input_length`."""
    seeds = splitmix64(np.asarray(hash_ids, dtype=np.uint64) ^ _HASH_SALT)
    grid = seeds[:, None] + _positions(hash_block_size)[None, :]
    return _to_token_range(splitmix64(grid.ravel()))[:input_length]


def unique_tokens(key: int, length: int) -> np.ndarray:
    """Tokens of a stream seeded by `key` alone, shared with no hash-id block."""
    seed = splitmix64(np.array([key & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) ^ _UNIQUE_SALT)
    return _to_token_range(splitmix64(seed + _positions(length)))


def request_key(req: TraceRequest) -> int:
    """A stable key from the request's fields, for callers without an index."""
    text = repr((req.arrival_s, req.input_length, req.output_length, req.session_id))
    return int.from_bytes(hashlib.blake2b(utf8(text), digest_size=8).digest(), "little")


def prompt_token_array(req: TraceRequest, hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE,
                       unique_key: int | None = None) -> np.ndarray:
    """`prompt_token_ids` as a uint64 numpy array (the fast path for analysis)."""
    if req.prompt_token_ids is not None:
        return np.asarray(req.prompt_token_ids, dtype=np.uint64)
    if req.hash_ids is not None:
        return tokens_of_hash_blocks(req.hash_ids, req.input_length, hash_block_size)
    if req.prompt is not None:
        tokens = byte_token_ids(req.prompt)
        if len(tokens) == req.input_length:
            return tokens
    key = request_key(req) if unique_key is None else unique_key
    return unique_tokens(key, req.input_length)


def prompt_token_ids(req: TraceRequest, hash_block_size: int = DEFAULT_HASH_BLOCK_SIZE,
                     unique_key: int | None = None) -> list[int]:
    """The prompt's token ids, deterministic; see the module docstring."""
    return prompt_token_array(req, hash_block_size, unique_key).tolist()


def workload_token_arrays(workload: Workload) -> Iterator[np.ndarray]:
    """Each request's prompt tokens as arrays, keyed by its index in the workload."""
    size = workload.hash_block_size
    for index, req in enumerate(workload.requests):
        yield prompt_token_array(req, size, index)


def workload_prompt_token_ids(workload: Workload) -> Iterator[list[int]]:
    """Each request's prompt token ids, in order; distinct requests never share by accident."""
    for tokens in workload_token_arrays(workload):
        yield tokens.tolist()
