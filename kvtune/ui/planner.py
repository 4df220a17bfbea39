"""Planner page: what fits in the KV cache of a model on a device, against a contiguous reservation.

The same computation as `kvtune plan` (kvtune.plan over kvengine.core.memory), with
the command's own model and device builders (kvtune.plan's), so both always agree.
"""
from __future__ import annotations

import re

import pandas as pd
import streamlit as st
from kvengine.config import (
    DEVICE_PRESETS,
    DTYPE_BYTES,
    KV_CACHE_DTYPES,
    MODEL_PRESETS,
    ConfigError,
    DeviceSpec,
    EngineConfig,
    GiB,
)
from kvengine.core.memory import KVCacheMemoryError

from kvtune.plan import CapacityPlan, ModelChoice, plan_capacity, planned_device, planned_model
from kvtune.report import fmt
from kvtune.ui import charts, tables

CUSTOM = "custom"
BLOCK_SIZES = (8, 16, 32, 64, 128)
DEFAULT_CONTEXTS = "1024, 4096, 8192"
_CONTEXT = re.compile(r"^(\d+(?:\.\d+)?)\s*([kK]?)$")


def parse_contexts(text: str) -> list[int]:
    """'1024, 4k, 8192' -> [1024, 4096, 8192]; raises ValueError naming the bad entry."""
    out = []
    for part in (p.strip() for p in re.split(r"[,\s]+", text.strip()) if p.strip()):
        m = _CONTEXT.match(part)
        if not m or float(m.group(1)) <= 0:
            raise ValueError(f"{part!r} is not a context length in tokens (e.g. 4096 or 4k)")
        out.append(int(float(m.group(1)) * (1024 if m.group(2) else 1)))
    return out


def capacity_frame(plan: CapacityPlan) -> pd.DataFrame:
    columns = [f"auto ({plan.model_dtype})" if c.kv_cache_dtype == "auto" else c.kv_cache_dtype
               for c in plan.by_dtype]
    rows = [("KV bytes per token", [fmt.kib(c.kv_bytes_per_token) for c in plan.by_dtype]),
            ("KV pool", [fmt.gib(c.pool_bytes) for c in plan.by_dtype]),
            ("KV blocks", [fmt.count(c.num_gpu_blocks) for c in plan.by_dtype]),
            ("tokens that fit", [fmt.count(c.pool_tokens) for c in plan.by_dtype])]
    for context in plan.contexts:
        rows.append((f"requests at once, paged: {context:,} tokens each",
                     [f"{c.max_concurrency[str(context)]:,.1f}" for c in plan.by_dtype]))
    rows.append((f"requests at once, contiguous: max_model_len ({plan.config.max_model_len:,}) reserved each",
                 [fmt.count(c.contiguous_requests) for c in plan.by_dtype]))
    return pd.DataFrame([[label, *cells] for label, cells in rows], columns=["", *columns])


def memory_frame(plan: CapacityPlan) -> pd.DataFrame:
    cfg = plan.config
    rows = [("device memory", plan.total_bytes),
            (f"× gpu_memory_utilization {cfg.gpu_memory_utilization:.2f}", plan.requested_bytes),
            ("− weights", plan.weights_bytes)]
    if plan.reserve_given:
        rows.append(("− reserve", plan.activation_bytes))
    else:
        rows += [(f"− activation peak ({cfg.max_num_batched_tokens:,} batched tokens)", plan.activation_bytes),
                 ("− overhead (CUDA context, graphs)", plan.overhead_bytes)]
    rows.append((f"= KV pool ({plan.primary.kv_cache_dtype})", plan.primary.pool_bytes))
    return pd.DataFrame([{"": label, "size (GiB)": value / GiB} for label, value in rows])


def model_inputs() -> ModelChoice:
    """The model, as `kvtune plan` is asked about it."""
    choice = st.selectbox("Model", [*MODEL_PRESETS, CUSTOM], index=list(MODEL_PRESETS).index("llama-3-8b"),
                          key="plan_model")
    args = ModelChoice()
    if choice != CUSTOM:
        args.preset = choice
        return args
    cols = st.columns(3)
    args.layers = cols[0].number_input("Layers", 1, 512, 32, key="plan_layers")
    args.kv_heads = cols[1].number_input("K/V heads", 1, 256, 8, key="plan_kv_heads")
    args.head_dim = cols[2].number_input("Head dim", 1, 1024, 128, key="plan_head_dim")
    cols = st.columns(3)
    args.heads = cols[0].number_input("Query heads", 1, 1024, 32, key="plan_heads")
    args.dtype = cols[1].selectbox("Weights dtype", list(DTYPE_BYTES), index=1, key="plan_dtype")
    weights = cols[2].number_input("Weights (GiB, 0: from the shape)", 0.0, 4096.0, 0.0, key="plan_weights")
    args.weights_gib = weights or None
    return args


def device_inputs() -> DeviceSpec:
    choice = st.selectbox("Device", [*DEVICE_PRESETS, CUSTOM], key="plan_device")
    if choice != CUSTOM:
        return planned_device(choice, None)
    memory = st.number_input("Device memory (GiB)", 1.0, 4096.0, 80.0, key="plan_memory")
    return planned_device(None, int(memory * GiB))


def render() -> None:
    st.title("Planner")
    st.caption("How many tokens and requests the KV cache holds for a model on a device, with fp8 beside the "
               "chosen dtype, against a server that reserves max_model_len per request up front. "
               "The same numbers as `kvtune plan`.")
    left, right = st.columns([1, 2])
    with left:
        model_args = model_inputs()
        device_args = device_inputs()
        utilization = st.slider("gpu_memory_utilization", 0.50, 0.99, EngineConfig.gpu_memory_utilization, 0.01,
                                key="plan_util")
        kv_dtype = st.selectbox("kv_cache_dtype", KV_CACHE_DTYPES, key="plan_kv_dtype")
        block_size = st.selectbox("block_size", BLOCK_SIZES, index=1, key="plan_block")
        contexts_text = st.text_input("Context lengths (prompt + output tokens)", DEFAULT_CONTEXTS,
                                      key="plan_contexts")
        max_len = st.number_input("max_model_len (0: the model's)", 0, 1 << 22, 0, step=1024, key="plan_max_len")
    with right:
        try:
            contexts = parse_contexts(contexts_text)
            model, device = planned_model(model_args), device_args
            if not max_len and model_args.layers is not None:  # a custom model has no limit of its own
                max_len = max(contexts, default=4096)
            config = EngineConfig(block_size=block_size, gpu_memory_utilization=utilization,
                                  kv_cache_dtype=kv_dtype, max_model_len=max_len or None)
            contexts = contexts or [config.resolve(model, device).max_model_len]
            plan = plan_capacity(model, device, config, contexts)
        except (ConfigError, ValueError) as err:
            st.error(f"Cannot plan this: {err}")
            return
        except KVCacheMemoryError as err:
            st.warning(f"Does not fit: {err}")
            return
        show_plan(plan)


def show_plan(plan: CapacityPlan) -> None:
    primary = plan.primary
    st.subheader(f"{plan.model} on {plan.device}")
    cols = st.columns(4)
    cols[0].metric("KV bytes per token", fmt.kib(primary.kv_bytes_per_token))
    cols[1].metric("KV pool", fmt.gib(primary.pool_bytes))
    cols[2].metric("Tokens that fit", fmt.count(primary.pool_tokens))
    longest = max(plan.contexts)
    cols[3].metric(f"Requests at {longest:,} tokens", f"{primary.max_concurrency[str(longest)]:,.1f}",
                   delta=f"{primary.contiguous_requests:,} if contiguous", delta_color="off", delta_arrow="off")
    tables.table(capacity_frame(plan), key="plan_table", column_config={"": st.column_config.TextColumn(width="large")})
    charts.show(charts.capacity(plan))
    if primary.contiguous_requests == 0:
        st.warning(f"The pool cannot hold one request of max_model_len {plan.config.max_model_len:,} reserved "
                   "up front.")
    st.caption("Paged KV blocks (vLLM, SGLang, kvengine) hold as many requests as their real length allows; the "
               "contiguous row is what a server reserving the worst case per request holds in the same memory. "
               "Plan for the p99 context, not the mean.")
    with st.expander("Where the memory goes"):
        tables.table(memory_frame(plan), key="plan_memory_table")


if __name__ == "__main__":
    render()
