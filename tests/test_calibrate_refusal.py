"""kvtune calibrate refuses a fit that is not usable as a cost profile (timings it could
not measure, a misfit over the limit, the step's cost left at the bounds), says why and
what to do, and saves nothing; a usable fit passes the same check."""
import copy
import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from kvengine.config import EngineConfig, device_preset, model_preset
from kvengine.executor.cost import CostCoefficients
from test_calibrate import DEVICE, KNOWN, MODEL, calibrate_cli, virtual_runs

from kvtune.calibrate import design_probes, fit_coefficients, step_shapes
from kvtune.calibrate.fit import (
    BOUNDS,
    MAIN_TERMS,
    RMS_LIMIT,
    degenerate_reasons,
    squeezed,
    unseen,
)
from kvtune.calibrate.design import ITL
from kvtune.calibrate.timings import chunk_gaps, steady_itl
from kvtune.store import Store


def exact_runs(known: CostCoefficients):
    config = EngineConfig(max_model_len=4096).resolve(model_preset(MODEL), device_preset(DEVICE))
    plan = design_probes(4096, max_batch=64, batch_tokens=config.max_num_batched_tokens, quick=True)
    return virtual_runs(plan, known, 2e-3, 5e-3, config, True), config


def fit(runs, config):
    shapes, observations = step_shapes(runs, model_preset(MODEL), device_preset(DEVICE), config)
    return fit_coefficients(shapes, observations, model_preset(MODEL), device_preset(DEVICE), "auto", 16)


@pytest.fixture(scope="module")
def exact():
    """Probes timed exactly by KNOWN (virtual time): their runs, config and fit."""
    runs, config = exact_runs(KNOWN)
    return runs, config, fit(runs, config)


# ---------------------------------------------------------------- fits that pass

def test_an_exact_fit_is_accepted(exact):
    result = exact[2]
    assert degenerate_reasons(result) == [] and result.refusal() == []
    assert result.dropped == []
    assert result.residuals()["all"]["rms"] < 0.01 < RMS_LIMIT


def test_a_host_bound_fit_with_its_roofline_terms_unseen_is_accepted():
    """A small model on a GPU: every step is the fixed overhead, so the weights' reads and the
    compute show in no timing and the fit leaves them at their top. The step overhead carries
    the step, so the profile is usable (only all three main terms unseen is refused)."""
    host_bound = dataclasses.replace(KNOWN, memory_efficiency=1e3, compute_efficiency=1e3, step_overhead_s=4e-3)
    result = fit(*exact_runs(host_bound))
    assert degenerate_reasons(result) == [], result.coefficients
    c = result.coefficients
    assert c.step_overhead_s == pytest.approx(4e-3, rel=0.02)
    assert c.memory_efficiency > 100 and c.compute_efficiency > 100  # priced at about nothing


def test_merged_chunks_time_the_tokens_they_carry():
    """A server that sends several tokens in one chunk (vLLM under load): the chunk's tokens
    share its receipt time, and the ITL is the span over the tokens made after the first
    chunk, not a mean with zero gaps in it."""
    made = [0.005 + 0.01 * i for i in range(24)]  # one token every 10 ms
    merged = [made[min(i // 3 * 3 + 2, 23)] for i in range(24)]  # delivered 3 at a time
    assert steady_itl([merged, merged]) == pytest.approx(0.01)
    assert np.mean(chunk_gaps(merged)) == pytest.approx(0.01)
    assert chunk_gaps(made) == pytest.approx(np.diff(made).tolist())  # one token a chunk: the gaps
    assert chunk_gaps([0.1, 0.1, 0.1]) == []  # one chunk: no gap to time


# ---------------------------------------------------------------- fits that are refused

def test_a_probe_whose_streams_came_in_one_chunk_is_refused_by_name(exact):
    """A loaded probe whose background delivered its window's tokens in one chunk each: its
    ITL is nan, the fit drops it, and the check names the probe."""
    runs, config, _ = exact
    runs = copy.deepcopy(runs)
    k, run = next((k, r) for k, r in enumerate(runs) if r.probe.background)
    trial = run.trials[0]
    start, end = trial.requests[0].sent, trial.requests[-1].token_times[0]
    for r in trial.background_requests:
        r.token_times = [t if t < start else end + 1.0 for t in r.token_times]  # all after the window
        inside = [i for i, t in enumerate(r.token_times) if t >= start]
        r.token_times[inside[0]] = (start + end) / 2  # one chunk in it
    assert np.isnan(runs[k].measured(ITL))
    result = fit(runs, config)
    assert [o.label for o in result.dropped] == [run.probe.label]
    reasons = degenerate_reasons(result)
    assert len(reasons) == 1 and reasons[0].startswith(f"probe {run.probe.label!r}: its itl is nan: too few "
                                                       "stream chunks")


def test_timings_the_model_cannot_explain_are_refused_with_their_rms(exact):
    runs, config, _ = exact
    shapes, observations = step_shapes(runs, model_preset(MODEL), device_preset(DEVICE), config)
    rng = np.random.default_rng(3)
    for o in observations:  # a factor of 2 either way, at random
        o.measured_s *= float(np.exp(rng.normal(0.0, 0.7)))
        o.se_s = 0.0
    result = fit_coefficients(shapes, observations, model_preset(MODEL), device_preset(DEVICE), "auto", 16)
    reasons = degenerate_reasons(result)
    rms = result.residuals()["all"]["rms"]
    assert rms > RMS_LIMIT
    assert f"residual rms over all timings is {rms:.1%} (n={len(observations)}" in "\n".join(reasons)
    assert all(r.endswith(f"over the {RMS_LIMIT:.0%} limit") for r in reasons if r.startswith("residual rms"))
    # The limit is the check's: a looser one lets this misfit through.
    assert not [r for r in degenerate_reasons(result, rms_limit=10.0) if "rms" in r]


def test_coefficients_at_their_bounds(exact):
    good = exact[2]

    def reasons(**changes):
        return degenerate_reasons(dataclasses.replace(good, coefficients=dataclasses.replace(good.coefficients,
                                                                                             **changes)))
    top = {"memory_efficiency": BOUNDS["memory_efficiency"][1], "compute_efficiency": BOUNDS["compute_efficiency"][1]}
    floor = {"step_overhead_s": BOUNDS["step_overhead_s"][0]}
    assert all(unseen(k, v) for k, v in {**top, **floor}.items())
    # Two main terms unseen: a host-bound GPU, fine. All three: no step cost at all.
    assert reasons(**top) == [] and reasons(**floor, memory_efficiency=top["memory_efficiency"]) == []
    (why,) = reasons(**top, **floor)
    assert why.startswith("all the step's main terms are at the bounds that price them at about zero (")
    assert all(name in why for name in MAIN_TERMS)
    # The other side of a bound (the timings asked for more than it allows): clipped, refused.
    assert squeezed("per_seq_overhead_s", 1.0) and not unseen("per_seq_overhead_s", 1.0)
    (why,) = reasons(per_seq_overhead_s=1.0)
    assert why.startswith("at the bound that makes their term dearest") and "per_seq_overhead_s 1" in why
    (why,) = reasons(attention_efficiency=1e-5)
    assert "attention_efficiency 1e-05" in why
    # (CostCoefficients takes finite numbers only; the client overheads are the fit's own floats.)
    assert degenerate_reasons(dataclasses.replace(good, client_overhead_busy_s=float("inf"))) == [
        "not finite: client_overhead_busy_s = inf"]
    # Overheads never fitted (0: no probe could show them) are no bound.
    assert reasons(per_prefill_overhead_s=0.0, busy_arrival_overhead_s=0.0) == []


# ---------------------------------------------------------------- the command

def backward_ttft(prompt_len: int) -> float:
    return 0.08 * 16 / max(16, prompt_len)  # a longer prompt answers sooner: 80 ms at 16 tokens, 0.6 ms at 2k


def backward_gap(i: int, active: int) -> float:
    return 0.016 / max(1, active)  # more streams, faster tokens (1 ms apart at 16: no burst)


class StreamServer:
    """An OpenAI-style streaming completions server (not an engine) that paces its answers by
    `ttft(prompt_len)` before the first token and `gap(i, streams active)` before token i.
    By default its timings run against any cost model (`backward_ttft`, `backward_gap`):
    every term of kvengine's cost model grows with the work, so no coefficients fit them."""

    def __init__(self, max_model_len: int = 2048, ttft=backward_ttft, gap=backward_gap):
        self.active = 0
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/v1/models":
                    self.send_error(404)
                    return
                body = json.dumps({"data": [{"id": "backward", "max_model_len": max_model_len}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                with owner.lock:
                    owner.active += 1
                try:
                    time.sleep(ttft(len(request["prompt"])))
                    held = b""  # lines due at once (a gap of 0) go out in one write, as a burst
                    for i in range(request["max_tokens"]):
                        pause = gap(i, owner.active) if i else 0.0
                        if pause and held:
                            self.wfile.write(held)
                            self.wfile.flush()
                            held = b""
                        time.sleep(pause)
                        chunk = {"choices": [{"index": 0, "text": " t"}], "usage": {"completion_tokens": i + 1}}
                        held += f"data: {json.dumps(chunk)}\n\n".encode()
                    self.wfile.write(held + b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client closed the stream (a loaded probe's background)
                finally:
                    with owner.lock:
                        owner.active -= 1

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256  # a probe's whole batch connects at once

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_a_refused_calibration_exits_1_says_why_and_saves_nothing(tmp_path, capsys):
    """A server whose timings run backwards (longer prompts sooner, bigger batches faster):
    the command refuses the fit, says why (each class's rms over the limit) and what to do,
    and stores nothing in the SQLite store."""
    db = f"sqlite:///{tmp_path}/kvtune.db"
    with StreamServer() as server:
        rc = calibrate_cli("--target", server.url, "--preset", "tiny", "--device", "cpu", "--name", "refused",
                           "--quick", "--max-batch", "8", "--db", db, "--json")
    out, err = capsys.readouterr()
    assert rc == 1, out
    assert "error: calibrate: the fit is not usable as a cost profile" in err
    assert f"over the {RMS_LIMIT:.0%} limit" in err
    assert "residual rms of the prefill probes is" in err and "residual rms over all timings is" in err
    assert "to do:" in err and "drop --quick" in err and "--max-num-seqs" in err and "--max-prompt" in err
    assert "the refused fit:" in err and err.rstrip().endswith("nothing saved")
    assert "stored in" not in out and '"name"' not in out  # no saved profile's report, no JSON
    with Store(db) as store:
        assert store.list_profiles() == []


def test_a_stream_sent_in_one_burst_is_timed_as_one_chunk():
    """vLLM on a busy CPU: its frontend falls behind and writes what it held at once, lines the
    client reads microseconds apart. Those are one chunk, so the steady ITL is the steps before
    the burst; a stream that came all in one burst has no ITL to give (nan, refused by name)."""
    import asyncio

    from kvtune.calibrate.stream import stream_request

    async def stream(url, max_tokens):
        async with httpx.AsyncClient(base_url=url, timeout=30.0, trust_env=False) as client:
            return await stream_request(client, "", [1000] * 8, max_tokens)

    # 50 ms between the first tokens: under the suite's load a 5 ms gap was now and then read late,
    # two tokens in one chunk (correctly timed as one)
    with StreamServer(ttft=lambda n: 0.005, gap=lambda i, active: 0.05 if i < 8 else 0.0) as server:
        timing = asyncio.run(stream(server.url, 24))
    times = timing.token_times
    assert len(times) == 24 and len(set(times[7:])) == 1  # token 8 on: one burst, one chunk
    assert len(set(times[:8])) == 8
    assert steady_itl([times, times]) == pytest.approx(np.mean(np.diff(times[:7])))  # the gaps before the burst
    with StreamServer(ttft=lambda n: 0.03, gap=lambda i, active: 0.0) as server:
        timing = asyncio.run(stream(server.url, 24))
    assert len(set(timing.token_times)) == 1 and np.isnan(steady_itl([timing.token_times] * 2))


def test_a_burst_is_one_chunk_however_slowly_the_client_reads_its_lines(monkeypatch):
    """A loaded host may preempt the client between two lines of one network read: the burst's
    lines keep the read's time, not the time each was parsed."""
    import asyncio

    from kvtune.calibrate import stream as stream_module
    from kvtune.loadgen import sse_payload

    def preempted(line):  # the client descheduled a few ms at every line, as on a busy host
        time.sleep(0.003)
        return sse_payload(line)

    monkeypatch.setattr(stream_module, "sse_payload", preempted)

    async def stream(url):
        async with httpx.AsyncClient(base_url=url, timeout=30.0, trust_env=False) as client:
            return await stream_module.stream_request(client, "", [1000] * 8, 16)

    with StreamServer(ttft=lambda n: 0.005, gap=lambda i, active: 0.05 if i < 4 else 0.0) as server:
        times = asyncio.run(stream(server.url)).token_times
    assert len(set(times[:4])) == 4 and len(set(times[3:])) == 1  # token 4 on: one write, one chunk
