"""VLLM's Prometheus metrics and the latencies they are made of."""
