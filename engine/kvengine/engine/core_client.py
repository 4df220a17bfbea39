"""The frontend's handle on the engine core process (vLLM V1's AsyncMPClient).

Handlers submit commands (add, abort, reset); a reader thread receives each
step's CoreOutputs, records its metrics, and hands every stream its events in
one call onto the event loop. A core that dies, cleanly or killed, turns every
open stream into a 503 error, then calls `on_death` (the server's: it exits, as
vLLM's frontend does, so a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass

from kvengine.engine.core import run_engine_core
from kvengine.engine.outputs import CoreOutputs, EngineInfo
from kvengine.core.request import RequestStatus, SamplingParams

log = logging.getLogger("kvengine.engine.core_client")


@dataclass(slots=True)
class Event:
    """What a request's stream receives: one token, or the end."""

    index: int  # the choice this engine request serves
    token_id: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    status: int = 400  # the HTTP status an error maps to: 400 a bad request, 503 a dead engine


@dataclass(slots=True)
class _Subscriber:
    aloop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    index: int


class EngineClient:
    def __init__(self, build, *build_args, start_timeout_s: float = 600.0):
        """Start the core process; `build(*build_args)` runs there and returns (engine, tokenizer,
        model name). Raises what the build raised (ConfigError, KVCacheMemoryError) here."""
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot live in a forked child
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=run_engine_core, args=(child_conn, build, build_args),
                                   name="kvengine-core", daemon=True)
        self.process.start()
        child_conn.close()
        self.info: EngineInfo = self._handshake(start_timeout_s)
        self.metrics = None  # set by the server before start(); records every step's stats
        self.on_death = None  # called with the reason, from the reader thread, once the core is dead
        self.error: str | None = None
        self._send_lock = threading.Lock()
        self._subscribers: dict[str, _Subscriber] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        self._reader = threading.Thread(target=self._read_outputs, name="kvengine-client-output", daemon=True)

    def _handshake(self, timeout_s: float) -> EngineInfo:
        if not self._conn.poll(timeout_s):
            self.process.kill()
            raise RuntimeError(f"the engine core did not start within {timeout_s:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine core process exited while starting "
                               f"(exit code {self.process.exitcode})") from None
        if kind == "error":
            self.process.join(5)
            raise payload
        return payload

    # -- called from handlers ---------------------------------------------------
    def start(self) -> None:
        self._reader.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        try:
            self._send(("shutdown",))
        except RuntimeError:
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self.error is None and self.process.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._subscribers)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            events: asyncio.Queue, index: int = 0) -> None:
        self._subscribers[request_id] = _Subscriber(asyncio.get_running_loop(), events, index)
        try:
            self._send(("add", request_id, prompt_token_ids, params, time.monotonic()))
        except RuntimeError:
            del self._subscribers[request_id]
            raise

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self._send(("abort", request_id, status))

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._replies[call_id] = done
        self._send(("reset_prefix_cache", call_id))
        return done

    def _send(self, command) -> None:
        if not self.alive:
            raise RuntimeError("the engine core is not running")
        try:
            with self._send_lock:
                self._conn.send(command)
        except (OSError, ValueError) as err:
            raise RuntimeError(f"the engine core is not running: {err}") from None

    # -- the reader thread --------------------------------------------------------
    def _read_outputs(self) -> None:
        try:
            while True:
                out: CoreOutputs = self._conn.recv()
                self._deliver(out)
                if out.dead:
                    self._die(out.dead)
                    return
        except (EOFError, OSError):
            if not self._stopping:
                self.process.join(1)
                self._die(f"engine core died: its process exited (exit code {self.process.exitcode})")
        except Exception as err:  # without this thread no token reaches a client: as good as dead
            log.exception("the engine core's output reader failed")
            self._die(f"engine core unreachable: its output reader failed: {err!r}")

    def _deliver(self, out: CoreOutputs) -> None:
        if self.metrics is not None:
            self.metrics.record(out)
        for call_id, result in out.replies:
            self._replies.pop(call_id).set_result(result)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        subscribers = self._subscribers
        for t in out.tokens:
            sub = subscribers.get(t.request_id)
            if sub is None:
                continue
            if t.finish_reason is not None:
                del subscribers[t.request_id]
            event = Event(sub.index, t.token_id, t.finish_reason, t.prompt_tokens, t.cached_tokens, t.error)
            by_loop.setdefault(sub.aloop, []).append((sub.events, event))
        for aloop, batch in by_loop.items():  # one wake-up of the event loop per step, not per token
            aloop.call_soon_threadsafe(_put_all, batch)

    def _die(self, why: str) -> None:
        log.error("%s", why)
        self.error = why
        subscribers, self._subscribers = self._subscribers, {}
        for sub in subscribers.values():
            sub.aloop.call_soon_threadsafe(sub.events.put_nowait, Event(
                sub.index, finish_reason="error", error=why, status=503))
        for done in self._replies.values():
            done.set_exception(RuntimeError(why))
        self._replies.clear()
        if self.on_death is not None:
            self.on_death(why)


def _put_all(batch) -> None:
    for events, event in batch:
        events.put_nowait(event)
