"""Workloads: what traffic to replay.

Read any supported trace (kvtune/Mooncake JSONL, Azure and BurstGPT CSV,
ShareGPT JSON, vLLM custom JSONL) into a `Workload`, transform it, synthesize
one, measure it, write it as kvtune JSONL, and turn its requests into prompt
token ids that carry the trace"s prefix sharing to any server. The `kvtune trace`
commands are in kvtune/cli/trace.py.
"""
from ..lazy import exports_of, lazy_face

EXPORTS = exports_of({
    ".arrivals": ("gamma_arrivals",),
    ".detect": ("FORMATS", "detect_format"),
    ".dist": ("IntDist", "parse_dist"),
    ".errors": ("RecordError", "TraceError", "TraceWarning"),
    ".model": ("DEFAULT_HASH_BLOCK_SIZE", "TraceRequest", "Workload"),
    ".readers": ("read_workload",),
    ".stats": ("PrefixReuse", "prefix_reuse", "workload_stats"),
    ".synth": ("SynthSpec", "synthesize"),
    ".tokens": ("TOKEN_ID_MAX", "TOKEN_ID_MIN", "count_tokens", "prompt_token_array", "prompt_token_ids", "workload_prompt_token_ids", "workload_token_arrays"),
    ".transforms": ("head", "length_scale", "rate_scale", "retime", "sample", "time_scale"),
    ".writers": ("write_workload",),
})
__getattr__, __dir__ = lazy_face(__name__, EXPORTS)
__all__ = sorted(EXPORTS)
