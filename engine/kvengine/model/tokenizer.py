"""Tokenizers: byte-level by default, or a model folder's tokenizer.json.

The byte-level tokenizer follows Llama's byte-fallback layout, so its ids are
valid in any Llama-family vocabulary: 0 <unk>, 1 <s> (bos), 2 </s> (eos), and
3 + b for byte b. Ids above that (which a model, or the simulator, may sample)
have no text of their own here; they decode to a stand-in word " t<id>" so
streams stay visible and stop strings stay testable.
"""
from __future__ import annotations

from pathlib import Path

UNK, BOS, EOS = 0, 1, 2
BYTE_OFFSET = 3


class ByteTokenizer:
    bos_token_id = BOS
    eos_token_id = EOS

    def __init__(self, vocab_size: int = 32000):
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least {BYTE_OFFSET + 256}, "
                             f"got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [BYTE_OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                pending.append(i - BYTE_OFFSET)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if i > BYTE_OFFSET + 255:
                out.append(f" t{i}")
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A model folder's tokenizer.json, through the `tokenizers` library (offline)."""

    def __init__(self, path: str | Path, vocab_size: int, bos_token_id: int | None = None,
                 eos_token_id: int | None = None):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str | Path | None, vocab_size: int, bos_token_id: int | None = None,
                   eos_token_id: int | None = None):
    """The folder's tokenizer.json when it has one, else the byte-level tokenizer."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").exists():
        return HFTokenizer(Path(model_dir) / "tokenizer.json", vocab_size, bos_token_id, eos_token_id)
    return ByteTokenizer(vocab_size)
