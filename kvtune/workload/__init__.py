"""Workloads: what traffic to replay.

Read any supported trace (kvtune/Mooncake JSONL, Azure and BurstGPT CSV,
ShareGPT JSON, vLLM custom JSONL) into a `Workload`, transform it, synthesize
one, measure it, write it as kvtune JSONL, and turn its requests into prompt
token ids that carry the trace's prefix sharing to any server.
"""
from .arrivals import gamma_arrivals
from .cli import add_trace_commands
from .detect import FORMATS, detect_format
from .dist import IntDist, parse_dist
from .errors import RecordError, TraceError, TraceWarning
from .model import DEFAULT_HASH_BLOCK_SIZE, TraceRequest, Workload
from .readers import read_workload
from .stats import PrefixReuse, prefix_reuse, workload_stats
from .synth import SynthSpec, synthesize
from .tokens import (
    TOKEN_ID_MAX,
    TOKEN_ID_MIN,
    count_tokens,
    prompt_token_array,
    prompt_token_ids,
    workload_prompt_token_ids,
    workload_token_arrays,
)
from .transforms import head, length_scale, rate_scale, retime, sample, time_scale
from .writers import write_workload

__all__ = [
    "DEFAULT_HASH_BLOCK_SIZE", "FORMATS", "TOKEN_ID_MAX", "TOKEN_ID_MIN",
    "IntDist", "PrefixReuse", "RecordError", "SynthSpec", "TraceError", "TraceRequest",
    "TraceWarning", "Workload",
    "add_trace_commands", "count_tokens", "detect_format", "gamma_arrivals", "head",
    "length_scale", "parse_dist", "prefix_reuse", "prompt_token_array", "prompt_token_ids",
    "rate_scale", "read_workload", "retime", "sample", "synthesize", "time_scale",
    "workload_prompt_token_ids", "workload_stats", "workload_token_arrays", "write_workload",
]
