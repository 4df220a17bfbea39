"""The engine loop: one thread owns the LLMEngine; HTTP handlers talk to it by message.

Handlers never touch the engine. They submit commands (add, abort, reset) to
a queue the loop drains between steps, and receive their tokens on an
asyncio queue the loop fills with `call_soon_threadsafe`. So a slow client or
a long step never blocks another handler, and the engine is single-threaded.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass

from .engine import LLMEngine
from .request import RequestStatus, SamplingParams

log = logging.getLogger("kvengine.loop")


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

    def put(self, event: Event) -> None:
        self.aloop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics=None, idle_wait_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._subscribers: dict[str, _Subscriber] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kvengine-loop", daemon=True)

    # -- called from handlers (any thread) --------------------------------------
    def start(self) -> None:
        self.thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._subscribers)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            events: asyncio.Queue, index: int = 0) -> None:
        sub = _Subscriber(asyncio.get_running_loop(), events, index)
        self._submit(lambda: self._add(request_id, prompt_token_ids, params, sub))

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self._submit(lambda: self.engine.abort(request_id, status))

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(lambda: done.set_result(self.engine.kv.reset_prefix_cache()))
        return done

    def _submit(self, command) -> None:
        if not self.alive:
            raise RuntimeError("the engine loop is not running")
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ------------------------------------------------------
    def _add(self, request_id, prompt_token_ids, params, sub: _Subscriber) -> None:
        try:
            req = self.engine.add_request(request_id, prompt_token_ids, params)
        except ValueError as err:  # checked by the handler already; a race is still an answer
            sub.put(Event(sub.index, finish_reason="error", error=str(err)))
            return
        self._subscribers[request_id] = sub
        sub.put(Event(sub.index, prompt_tokens=req.num_prompt_tokens))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if self.engine.has_unfinished():
                    step = self.engine.step()
                    if self.metrics is not None:
                        self.metrics.observe_step(step)
                    self._publish_tokens(step)
                else:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                self._publish_finished()
        except BaseException as err:  # the server must answer 503 from now on, not hang
            log.exception("engine loop died")
            self.error = err
            for sub in self._subscribers.values():
                sub.put(Event(sub.index, finish_reason="error", error=f"engine loop died: {err!r}", status=503))
            self._subscribers.clear()

    def _publish_tokens(self, step) -> None:
        """A request's last token carries its finish reason, as vLLM's last chunk does."""
        subscribers = self._subscribers
        for req, token in step.new_tokens:
            sub = subscribers.get(req.request_id)
            if sub is None:
                continue
            if req.is_finished:
                del subscribers[req.request_id]
                sub.put(Event(sub.index, token, req.finish_reason, req.num_prompt_tokens,
                              max(req.num_cached_tokens, 0)))
            else:
                sub.put(Event(sub.index, token))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _publish_finished(self) -> None:
        finished = self.engine.finished
        if not finished:
            return
        for req in finished:
            sub = self._subscribers.pop(req.request_id, None)  # still here: ended without a token
            if self.metrics is not None:
                self.metrics.observe_finished(req, req.sampling_params.n)
            if sub is not None:
                sub.put(Event(sub.index, finish_reason=req.finish_reason,
                              prompt_tokens=req.num_prompt_tokens,
                              cached_tokens=max(req.num_cached_tokens, 0)))
        finished.clear()
