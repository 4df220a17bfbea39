"""The model: its shape (spec, hf_config, the presets in configs/), and the real decoder, its KV cache
tensors, the checkpoint loader, tokenizer, sampler, CPU kernels."""
