"""A tiny random Llama checkpoint that kvengine and a real vLLM both serve.

transformers' own classes build the model (random weights from a seed) and save
it as safetensors; the tokenizer is a WordLevel one from the `tokenizers`
library with a chat template, written beside it. Nothing is downloaded.

    python tests/checkpoint.py DIR [--dtype bfloat16|float32]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# The shape of kvengine's `tiny` preset, so the sim's presets describe it.
TINY_LLAMA = dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False)
SPECIAL = ["<unk>", "<s>", "</s>"]
# One line per turn, then the assistant's cue: short, so a chat prompt's token count is easy to check.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")
DONE = ".kvtune-checkpoint"


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False,
        "model_max_length": TINY_LLAMA["max_position_embeddings"], "chat_template": CHAT_TEMPLATE}))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def write_tiny_llama(path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """The checkpoint in `path` (made once: a finished folder is reused)."""
    import torch
    import transformers as tf

    path = Path(path)
    if (path / DONE).read_text().strip() == dtype if (path / DONE).is_file() else False:
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tf.LlamaConfig(**TINY_LLAMA, torch_dtype=dtype)
    model = tf.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, TINY_LLAMA["vocab_size"])
    (path / DONE).write_text(dtype)
    return path


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args()
    print(write_tiny_llama(args.path, args.dtype), file=sys.stdout)
