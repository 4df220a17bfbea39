"""LLMEngine with the sim executor in virtual time: numbers checkable by hand."""
import dataclasses

import numpy as np
import pytest

from kvengine.engine.clock import VirtualClock
from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.executor.cost import (STEP_SHAPE_FIELDS, CostCoefficients, StepCost, device_coefficients, StepShape, kernel_pairs, step_shape,
                                   torch_attention_kernel)
from kvengine.engine.llm_engine import LLMEngine
from kvengine.core.request import PromptTooLongError, SamplingParams
from kvengine.metrics.stats import request_timings

MODEL, DEVICE = model_preset("llama-3-8b"), device_preset("h100-80gb")


def engine(**kw):
    return LLMEngine(EngineConfig(**kw), MODEL, DEVICE)


def run_all(e):
    while e.has_unfinished():
        e.step()


def test_one_request_alone_ttft_is_one_prefill_step():
    e = engine()
    req = e.add_request("a", list(range(1000, 2000)), SamplingParams(max_tokens=4, ignore_eos=True))
    run_all(e)
    t = request_timings(req)
    prefill = e.cost.step_time(StepShape(1000, 1, 1000, 1000 * 1001 // 2, 1, 1))  # causal pairs, one prefill
    assert t.ttft == pytest.approx(prefill)
    decodes = [e.cost.step_time(StepShape(1, 1, ctx, ctx)) for ctx in (1001, 1002, 1003)]
    assert t.itl == pytest.approx(tuple(decodes))
    assert t.tpot == pytest.approx(sum(decodes) / 3)
    assert t.e2e == pytest.approx(prefill + sum(decodes))
    assert t.queue == 0 and t.output_tokens == 4 and t.finish_reason == "length"
    assert len(e.steps) == 4 and e.steps.num_tokens == [1000, 1, 1, 1]


def test_two_identical_prompts_second_is_served_from_cache():
    e = engine()
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16
    first = e.add_request("a", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    run_all(e)
    second = e.add_request("b", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    run_all(e)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96
    assert e.steps.num_tokens[2] == 4  # only the uncached tail is prefilled
    assert sum(e.steps.prefix_queries) == 200 and sum(e.steps.prefix_hits) == 96


def test_replay_waits_for_arrivals_and_skips_idle_time():
    e = engine()
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    e.replay([(0.0, "a", [5] * 50, sp), (10.0, "b", [6] * 50, sp)])
    a, b = e.finished
    assert b.first_scheduled_time == pytest.approx(10.0)
    assert request_timings(b).queue == 0.0
    assert e.clock.now == pytest.approx(b.finish_time) and b.finish_time < 10.1


def test_prompt_over_max_model_len_is_rejected_and_max_tokens_clamped():
    e = engine(max_model_len=128)
    with pytest.raises(PromptTooLongError, match=r"length 200\) is longer than the maximum model length of 128"):
        e.add_request("x", [1] * 200)
    with pytest.raises(PromptTooLongError, match="plus the number of requested output tokens"):
        e.add_request("y", [1] * 128)
    req = e.add_request("z", [1] * 100, SamplingParams(max_tokens=1000))
    assert req.max_tokens == 28
    rejected = []
    e.replay([(0.0, "long", [1] * 500, SamplingParams())], on_reject=lambda rid, err: rejected.append(rid))
    assert rejected == ["long"]


def test_abort_returns_blocks():
    e = engine()
    e.add_request("a", list(range(300)), SamplingParams(max_tokens=50))
    e.step()
    assert e.kv.usage() > 0
    assert e.abort("a") and not e.abort("a")
    assert e.kv.usage() == 0 and e.finished[0].finish_reason == "abort"


def test_step_log_records_preemptions_and_usage():
    e = engine(num_gpu_blocks_override=600, max_model_len=2048)
    sp = SamplingParams(max_tokens=400, ignore_eos=True)
    e.replay([(0.0, f"r{i}", [i + 1000] * 1200, sp) for i in range(8)])
    assert sum(e.steps.num_preemptions) == e.num_preemptions > 0
    assert max(e.steps.kv_usage) > 0.9
    assert len(e.finished) == 8 and e.kv.usage() == 0
    assert all(n <= e.config.max_num_batched_tokens for n in e.steps.num_tokens)


def test_logits_cost_only_where_a_token_is_sampled():
    """vLLM computes the lm_head only for the rows it samples: a prefill chunk that does not
    finish its prompt pays no lm_head, and prefill tokens pay none but the last."""
    tiny = model_preset("tiny")  # vocab 32000 x hidden 256: most of its parameters
    cost = StepCost.build(tiny, DEVICE, "auto", 16, CostCoefficients(memory_efficiency=1e6))  # compute-bound
    head = cost.flops_per_sample / cost.flops_per_s
    mid_chunk, last_chunk = cost.step_time(StepShape(1024, 1, 1024, 0, 0)), cost.step_time(StepShape(1024, 1, 1024, 0, 1))
    assert last_chunk - mid_chunk == pytest.approx(head)
    assert cost.flops_per_token == pytest.approx(2 * (tiny.num_params - 2 * 32000 * 256))


def test_decode_attention_has_its_own_efficiency_where_one_is_given():
    tiny = model_preset("tiny")
    shared = CostCoefficients(memory_efficiency=1e6)  # compute-bound: attention shows
    apart = dataclasses.replace(shared, decode_attention_efficiency=shared.attention_efficiency / 2)
    # 8 decodes over 1000-token contexts beside a 100-token prefill chunk.
    shape = (108, 9, 8 * 1000 + 100, 8 * 1000 + 100 * 101 // 2, 9, 1, 0)
    one = StepCost.build(tiny, DEVICE, "auto", 16, shared)
    assert one.step_time(StepShape(*shape, 8 * 1000)) == pytest.approx(one.step_time(StepShape(*shape)))  # tied: same time
    two = StepCost.build(tiny, DEVICE, "auto", 16, apart)
    decode_attention = 8 * 1000 * two.attention_flops_per_pair / two.attention_flops_per_s
    assert two.step_time(StepShape(*shape, 8 * 1000)) - one.step_time(StepShape(*shape)) == pytest.approx(decode_attention)


def test_chunks_after_context_have_their_own_attention_efficiency_where_one_is_given():
    tiny = model_preset("tiny")
    shared = CostCoefficients(memory_efficiency=1e6)  # compute-bound: attention shows
    apart = dataclasses.replace(shared, context_attention_efficiency=shared.attention_efficiency / 2)
    # A 100-token chunk after 900 cached tokens beside a fresh 50-token prefill.
    chunk, fresh = 100 * 1000, 50 * 51 // 2
    shape = (150, 2, 1050, chunk + fresh, 2, 2, 0, 0)
    one = StepCost.build(tiny, DEVICE, "auto", 16, shared)
    assert one.step_time(StepShape(*shape, chunk)) == pytest.approx(one.step_time(StepShape(*shape)))  # tied: same time
    two = StepCost.build(tiny, DEVICE, "auto", 16, apart)
    context_attention = chunk * two.attention_flops_per_pair / two.attention_flops_per_s
    assert two.step_time(StepShape(*shape, chunk)) - one.step_time(StepShape(*shape)) == pytest.approx(context_attention)


def test_a_step_shapes_fields_are_step_times_columns_in_order():
    """The fit reads shape columns by these names; a field added to one and not the other
    would price the wrong column."""
    assert list(STEP_SHAPE_FIELDS) == [f.name for f in dataclasses.fields(StepShape)]
    shape = StepShape(*range(1, len(STEP_SHAPE_FIELDS) + 1))
    assert list(np.asarray(shape)) == list(range(1, len(STEP_SHAPE_FIELDS) + 1))  # a row, in that order
    cost = StepCost.build(MODEL, DEVICE, "auto", 16)
    assert cost.step_times(np.array([shape, shape]))[1] == pytest.approx(cost.step_time(shape), rel=1e-12, abs=0)


def test_step_shape_counts_the_pairs_of_chunks_after_context_apart():
    """A prefix hit's chunk (and a long prompt's later chunks) is the shape's last field,
    counted as the kernel counts it; fresh chunks and decodes are not in it."""
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8)

    def shapes_of(kernel) -> list[StepShape]:
        engine = LLMEngine(config, model_preset("tiny"), DEVICE)
        executor = engine.executor
        executor.cost = dataclasses.replace(executor.cost, attention_key_block=kernel[0],
                                            context_chunk_all_keys=kernel[1])
        shapes = []
        executor.step_time = lambda shape: shapes.append(shape) or StepCost.step_time(executor.cost, shape)
        engine.add_request("a", list(range(1000, 1100)), SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        return shapes

    for kernel in ((0, False), (512, True)):
        shapes = shapes_of(kernel)
        # 100 tokens at 64 a step: a fresh chunk, then 36 after 64, then one decode.
        assert [s.context_chunk_pairs for s in shapes] == [0, kernel_pairs(36, 100, *kernel), 0]
        assert [s.decode_token_pairs for s in shapes] == [0, 0, 101]
        assert shapes[0].attention_token_pairs == kernel_pairs(64, 64, *kernel)


def test_the_sim_counts_attention_pairs_as_the_servers_kernel_does():
    """A prefill through torch's CPU flash attention computes whole 512-key blocks: a
    512-token prompt pays for 512 x 512 pairs, not the causal half of them."""
    tiny = model_preset("tiny")
    causal = CostCoefficients(memory_efficiency=1e6)  # compute-bound: attention shows
    blocked = dataclasses.replace(causal, **torch_attention_kernel("cpu"))

    def prefill_time(coeffs):
        engine = LLMEngine(EngineConfig(), tiny, DEVICE, clock=VirtualClock(), cost_coefficients=coeffs)
        engine.add_request("r", list(range(1000, 1512)), SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()
        return engine.clock.now, StepCost.build(tiny, DEVICE, "auto", 16, coeffs)

    (t_causal, cost), (t_blocked, _) = prefill_time(causal), prefill_time(blocked)
    wasted = 512 * 512 - 512 * 513 // 2  # the diagonal block's masked half
    assert t_blocked - t_causal == pytest.approx(wasted * cost.attention_flops_per_pair / cost.attention_flops_per_s)
    with pytest.raises(ValueError, match="attention_key_block must be a whole number of keys, got 1.5"):
        CostCoefficients(attention_key_block=1.5)
    with pytest.raises(ValueError, match="attention_key_block must be >= 0, got -1"):
        CostCoefficients(attention_key_block=-1)
    with pytest.raises(ValueError, match="context_chunk_all_keys must be true or false, got 'yes'"):
        CostCoefficients(context_chunk_all_keys="yes")


def test_fp8_and_block_size_move_the_step_time_the_right_way():
    def decode_step(dtype="auto", bs=16):
        return StepCost.build(MODEL, DEVICE, dtype, bs).step_time(StepShape(256, 256, 256 * 4000, 256 * 4000))
    assert decode_step("fp8") < decode_step("auto")
    assert decode_step(bs=8) > decode_step(bs=16) > decode_step(bs=64)
    small = StepCost.build(MODEL, DEVICE, "auto", 16).step_time(StepShape(1, 1, 100, 100))
    # batch 1 decode: weight-bound, reading every weight but the untied input embedding
    streamed = MODEL.weight_bytes - MODEL.vocab_size * MODEL.hidden_size * MODEL.dtype_bytes
    c = device_coefficients(DEVICE)  # the preset's fitted GPU kernels
    weights_time = streamed / (DEVICE.hbm_bandwidth * c.memory_efficiency)
    floors = c.step_overhead_s + c.layer_overhead_s * MODEL.num_layers + c.per_seq_overhead_s
    assert c.layer_overhead_s > 0 and small == pytest.approx(weights_time + floors, rel=0.01)
    prefill = StepCost.build(MODEL, DEVICE, "auto", 16).step_time(StepShape(8192, 1, 8192, 8192 * 8192))
    assert prefill > 10 * small  # a long prefill is compute-bound


def test_an_arrival_costs_a_busy_step_its_frontend_overhead_and_an_idle_one_nothing():
    coeffs = CostCoefficients(busy_arrival_overhead_s=0.01)
    e = LLMEngine(EngineConfig(), MODEL, DEVICE, cost_coefficients=coeffs)
    a = e.add_request("a", list(range(1000, 1100)), SamplingParams(max_tokens=4, ignore_eos=True))
    e.step()  # a alone on an idle engine
    assert a.first_token_time == pytest.approx(e.cost.step_time(StepShape(100, 1, 100, 100 * 101 // 2, 1, 1)))
    b = e.add_request("b", list(range(2000, 2050)), SamplingParams(max_tokens=1, ignore_eos=True))
    before = e.clock.now
    e.step()  # b admitted beside a's decode
    pairs = 101 + 50 * 51 // 2
    assert e.clock.now - before == pytest.approx(e.cost.step_time(StepShape(51, 2, 151, pairs, 2, 1, 1)))
    assert e.clock.now - before == pytest.approx(e.cost.step_time(StepShape(51, 2, 151, pairs, 2, 1, 0)) + 0.01)
    assert b.first_token_time == e.clock.now


@pytest.mark.parametrize("coeffs", [CostCoefficients(), CostCoefficients(memory_efficiency=1e6),
                                    CostCoefficients(**torch_attention_kernel("cpu"), per_prefill_overhead_s=1e-3,
                                                     busy_arrival_overhead_s=2e-3, kv_dequant_per_element_s=1e-9)])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("shard", ["tiny", "gemma-2-9b/2"])
def test_step_times_of_many_shapes_are_step_time_of_each(coeffs, kv_dtype, shard):
    """The calibration fit's array pricing and the simulator's per-step pricing are one formula
    (also with sliding-window layers and measured all-reduces: Gemma 2 at TP 2 on an H100)."""
    import numpy as np
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4096, 500)
    tokens[:10] = 0  # an empty step costs nothing
    seqs = rng.integers(1, 256, 500)
    shapes = np.stack([tokens, seqs, rng.integers(0, 10**6, 500), rng.integers(0, 10**8, 500), seqs,
                       rng.integers(0, 8, 500), rng.integers(0, 8, 500), rng.integers(0, 10**6, 500),
                       rng.integers(0, 10**6, 500), rng.integers(0, 10**6, 500), rng.integers(0, 10**6, 500)],
                      axis=1)
    assert shapes.shape[1] == len(STEP_SHAPE_FIELDS)
    name, _, tp = shard.partition("/")
    cost = StepCost.build(model_preset(name).tp_shard(int(tp or 1)), DEVICE, kv_dtype, 16, coeffs)
    assert (cost.allreduce_curve != ()) == bool(tp)
    scalar = [cost.step_time(StepShape(*(int(v) for v in row))) for row in shapes]
    assert cost.step_times(shapes.astype(float)) == pytest.approx(scalar, rel=1e-12, abs=0)
    assert not cost.step_times(shapes[:10]).any()


def test_a_quantized_cache_prices_its_gathered_tokens_and_steps_where_auto_does_not():
    """step_shape counts what a gathering path reads: decodes padded to the longest one's blocks,
    each prefill chunk's context in whole blocks; only a quantized dtype pays for it."""
    e = LLMEngine(EngineConfig(block_size=16, max_num_batched_tokens=4096), MODEL, DEVICE, clock=VirtualClock())
    for i, n in enumerate((10, 40)):
        e.add_request(str(i), list(range(1, n + 1)), SamplingParams(max_tokens=4, ignore_eos=True))
    e.step()  # both prefills
    e.add_request("late", list(range(100, 120)), SamplingParams(max_tokens=1, ignore_eos=True))
    out = e.scheduler.schedule()
    shape = step_shape(out, [1] * len(out.scheduled), block_size=16)
    assert sorted(out.num_new_tokens) == [1, 1, 20]
    assert shape.gathered_tokens == 2 * 48 + 32  # decodes at 11 and 41 tokens: 2 x 3 blocks; the chunk: 2
    coeffs = CostCoefficients(quantized_step_overhead_s=1e-3, kv_dequant_per_element_s=1e-12)
    auto, fp8 = (StepCost.build(MODEL, DEVICE, d, 16, coeffs) for d in ("auto", "fp8"))
    plain = StepCost.build(MODEL, DEVICE, "fp8", 16, CostCoefficients())
    elements = 2 * MODEL.num_layers * MODEL.num_kv_heads * MODEL.head_dim
    assert auto.kv_dequant_s_per_token == auto.quantized_step_overhead_s == 0
    assert fp8.step_time(shape) - plain.step_time(shape) == pytest.approx(1e-3 + 128 * elements * 1e-12)
