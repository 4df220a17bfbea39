"""The engine core process: the LLMEngine and its busy loop, alone in a process (vLLM V1's EngineCoreProc).

The HTTP frontend (parsing, tokenizing, detokenizing, streaming, Prometheus)
runs in another process, so the two never share a GIL: a burst of arrivals or
a thousand open streams no longer stretch the engine's steps. Commands arrive
on a pipe; an input thread queues them so a sender never waits on a step.
After each step the core sends one CoreOutputs, from the busy loop itself: an
output thread (as vLLM has) saves the ~100 us pipe write per step on paper,
but measured under traffic on 2 CPUs its GIL hand-offs made TPOT 5% worse.
"""
from __future__ import annotations

import logging
import queue
import signal
import sys
import threading
import time
import traceback

from kvengine.config import ConfigError
from kvengine.core.memory import KVCacheMemoryError
from kvengine.engine.outputs import CoreOutputs, EngineInfo, TokenOutput, finished_stats, iteration_stats, scheduler_stats

log = logging.getLogger("kvengine.engine.core")

# At Python's default 5 ms switch interval a thread that wakes (a command read off the
# pipe, a stream's token) can wait up to 5 ms for the GIL behind a busy one.
GIL_SWITCH_INTERVAL_S = 50e-6

SHUTDOWN = ("shutdown",)


def run_engine_core(conn, build, build_args) -> None:
    """The child process's main: build the engine, say so, then serve commands until told to stop."""
    # Ctrl-C, `docker stop` or a process-group SIGTERM reach both processes: the core keeps
    # serving in-flight streams until the frontend, shutting down gracefully, says stop (or its
    # pipe closes because it died).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        engine, tokenizer, model_name = build(*build_args)
    except (ConfigError, KVCacheMemoryError) as err:
        conn.send(("error", err))
        return
    except BaseException:
        conn.send(("error", RuntimeError(f"the engine core failed to start:\n{traceback.format_exc()}")))
        return
    conn.send(("ready", EngineInfo(engine.config, model_name, engine.memory.num_gpu_blocks,
                                   engine.memory.log_lines(engine.config.max_model_len), tokenizer,
                                   scheduler_stats(engine))))
    EngineCore(engine, conn).run()


class EngineCore:
    def __init__(self, engine, conn):
        self.engine = engine
        self.conn = conn
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        threading.Thread(target=self._read_commands, name="kvengine-core-input", daemon=True).start()
        try:
            while True:
                out = CoreOutputs()
                if not self._handle_commands(out, block=not self.engine.has_unfinished()):
                    return
                if self.engine.has_unfinished():
                    self._step(out)
                self._collect_finished(out)
                if out:
                    out.scheduler = scheduler_stats(self.engine)
                    self.conn.send(out)
        except BaseException as err:  # the frontend must answer 503 from now on, not hang
            log.exception("engine core died")
            self._send_quietly(CoreOutputs(dead=f"engine core died: {err!r}"))
            raise SystemExit(1) from None

    def _read_commands(self) -> None:
        try:
            while True:
                self.inbox.put(self.conn.recv())
        except (EOFError, OSError):  # the frontend is gone: nobody is left to serve
            self.inbox.put(SHUTDOWN)

    def _handle_commands(self, out: CoreOutputs, block: bool) -> bool:
        """Run what is queued (waiting for one when idle); False on shutdown."""
        while True:
            try:
                command = self.inbox.get() if block else self.inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "add":
                self._add(out, *command[1:])
            elif kind == "abort":
                self.engine.abort(command[1], command[2])
            elif kind == "reset_prefix_cache":
                out.replies.append((command[1], self.engine.kv.reset_prefix_cache()))
            elif kind == "shutdown":
                return False

    def _add(self, out: CoreOutputs, request_id, prompt_token_ids, params, sent_at: float) -> None:
        # The request arrived when the frontend sent it, not when a step let the core read it.
        arrival = self.engine.clock.now - max(0.0, time.monotonic() - sent_at)
        try:
            self.engine.add_request(request_id, prompt_token_ids, params, arrival_time=arrival)
        except ValueError as err:  # checked by the frontend already; a race is still an answer
            out.tokens.append(TokenOutput(request_id, None, "error", error=str(err)))
        except Exception as err:  # one request the frontend let through must not end the others
            log.exception("refused request %s", request_id)
            out.tokens.append(TokenOutput(request_id, None, "error", error=f"the engine refused it: {err!r}"))

    def _step(self, out: CoreOutputs) -> None:
        step = self.engine.step()
        out.iteration = iteration_stats(step)
        for req, token in step.new_tokens:  # a request's last token carries its finish reason
            out.tokens.append(_end(req, token) if req.is_finished else TokenOutput(req.request_id, token))

    def _collect_finished(self, out: CoreOutputs) -> None:
        finished = self.engine.finished
        if not finished:
            return
        ended_with_token = {t.request_id for t in out.tokens if t.finish_reason is not None}
        for req in finished:
            out.finished.append(finished_stats(req))
            if req.request_id not in ended_with_token:  # aborted, or ended before a token
                out.tokens.append(_end(req, None))
        finished.clear()

    def _send_quietly(self, out: CoreOutputs) -> None:
        try:
            self.conn.send(out)
        except (OSError, ValueError):
            pass


def _end(req, token: int | None) -> TokenOutput:
    """A finished request's last stream event: its finish reason and prompt usage."""
    return TokenOutput(req.request_id, token, req.finish_reason, req.num_prompt_tokens, max(req.num_cached_tokens, 0))
