"""The real model: the decoder, its KV cache tensors, the checkpoint loader, tokenizer, sampler, CPU kernels."""
