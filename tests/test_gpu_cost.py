"""The simulator's GPU step model: measured all-reduces, FP8 GEMMs, fitted kernels, windowed K/V reads."""
import dataclasses
import math

import pytest

from kvengine.config import device_preset, model_preset
from kvengine.executor.cost import CostCoefficients, StepCost, StepShape, allreduce_curve, device_coefficients
from kvengine.model.spec import quantized


def test_gpu_presets_price_all_reduces_from_the_measured_table_and_fp8_gemms_at_the_fp8_rate():
    """The H100 preset's all-reduces follow NCCL's measured times by size and ranks (not the
    bandwidth formula), a device without a table keeps the formula, and an fp8 checkpoint's GEMMs
    run at the FP8 tensor rate where the GPU has one (not on an A100)."""
    h100, b200, a100 = device_preset("h100-80gb"), device_preset("b200-180gb"), device_preset("a100-80gb")
    shard = model_preset("llama-3.1-70b").tp_shard(4)
    cost = StepCost.build(shard, h100, "auto", 16)
    log_bytes, log_s = allreduce_curve("nvlink4", 4)
    assert list(log_s) == sorted(log_s)  # non-decreasing in size
    one = cost._measured_allreduces(1)
    assert one == pytest.approx(2 * shard.num_layers * min(math.exp(v) for v in log_s))
    assert cost._measured_allreduces(8192) > 5 * one  # large messages are bandwidth-bound
    assert cost.allreduce_s == 0 and StepCost.build(shard, b200, "auto", 16).allreduce_s > 0  # b200: no table
    assert allreduce_curve("nvlink4", 3) == ()  # ranks never measured: the formula
    assert device_coefficients(h100) != device_coefficients(device_preset("cpu"))
    prefill = StepShape(num_tokens=8192, num_seqs=1, context_tokens=8192, attention_token_pairs=0, num_samples=1)
    fp8 = quantized(model_preset("llama-3.1-8b"), "fp8")
    bf16 = dataclasses.replace(fp8, weight_quant=None)
    # compute-bound: the fp8 GEMMs at twice the rate on Hopper, the same rate on Ampere
    assert StepCost.build(fp8, h100, "auto", 16).flops_per_s == pytest.approx(
        StepCost.build(bf16, h100, "auto", 16).flops_per_s * h100.fp8_flops / h100.bf16_flops)
    assert StepCost.build(fp8, a100, "auto", 16).flops_per_s == StepCost.build(bf16, a100, "auto", 16).flops_per_s
    assert StepCost.build(fp8, h100, "auto", 16).step_time(prefill) < StepCost.build(bf16, h100, "auto", 16).step_time(prefill)


def test_sliding_window_layers_read_only_their_window_of_a_long_context():
    """Gemma 2 alternates full and 4,096-token sliding layers: a decode at 32k context reads the
    full layers' K/V of 32k tokens and the sliding layers' of 4,096; made all-full it reads 32k in each."""
    gemma = model_preset("gemma-2-9b")
    full = dataclasses.replace(gemma, layer_types=("full",) * gemma.num_layers, sliding_window=None)
    h100, c = device_preset("h100-80gb"), CostCoefficients(step_overhead_s=0.0, per_seq_overhead_s=0.0)
    window = gemma.sliding_window
    decode = StepShape(num_tokens=1, num_seqs=1, context_tokens=32768, attention_token_pairs=0, num_samples=1,
                       windowed_context_tokens=min(32768, window))
    hybrid_cost, full_cost = StepCost.build(gemma, h100, "auto", 16, c), StepCost.build(full, h100, "auto", 16, c)
    sliding = gemma.attention_kinds.count("sliding") / gemma.num_layers
    assert 0 < sliding < 1 and hybrid_cost.window == window and full_cost.window is None
    saved = sliding * full_cost.kv_read_bytes_per_token * (32768 - window) / full_cost.bytes_per_s
    assert full_cost.step_time(decode) - hybrid_cost.step_time(decode) == pytest.approx(saved, rel=1e-9)


def test_the_fitted_kernels_are_the_shipped_fit_of_vidurs_profiles():
    """H100 and H200 share Hopper's fit, A100 and the PCIe cards Ampere's; the CPU keeps the defaults."""
    import json

    from kvengine.executor.cost import DATA

    shipped = json.loads((DATA / "gpu_efficiency.json").read_text())
    assert "vidur" in shipped["source"].lower()
    hopper = shipped["kernels"]["hopper"]["coefficients"]
    assert device_coefficients(device_preset("h200-141gb")) == CostCoefficients(**hopper)
    assert device_coefficients(device_preset("l4-24gb")) == device_coefficients(device_preset("a100-40gb"))
    assert device_coefficients(device_preset("cpu")) == CostCoefficients()
