"""Small random Hugging Face checkpoints on disk, and what transformers makes of them.

The reference side of the torch-executor tests: transformers' own classes build
and save the checkpoints (save_pretrained, safetensors) and run generate().
Nothing is downloaded.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def save_checkpoint(path, kind: str = "llama", seed: int = 0, max_shard_size=None, **overrides):
    """A random model of `kind` (llama, qwen2, mistral) saved to `path`; returns it (eval, fp32)."""
    import transformers as tf

    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    config = config_cls(**{**SMALL, "bos_token_id": 1, "eos_token_id": 2, **overrides})
    model = model_cls(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate() of one prompt, run to max_new_tokens (no eos stop)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """float32 logits at every position of one sequence: [len, vocab]."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def random_prompts(lengths, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
