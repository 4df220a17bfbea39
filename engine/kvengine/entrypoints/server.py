"""The OpenAI-compatible HTTP server, indistinguishable from `vllm serve` to clients.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /version, GET /load, GET /metrics, and with VLLM_SERVER_DEV_MODE=1
(as vLLM) POST /reset_prefix_cache. Handlers parse and check a request, hand it
to the engine core, and stream its tokens back. A client that goes away, streaming
or not, aborts its requests: the guard middleware aborts whatever a request left
unfinished once its ASGI call ends, however it ends.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field

import h11
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvengine import __version__
from kvengine.entrypoints.chat_template import ChatTemplate
from kvengine.engine.core_client import EngineClient, Event
from kvengine.entrypoints.limits import (REQUEST_READ_TIMEOUT_S, ServerLimits, check_capacity, check_max_tokens, check_n,
                     check_prompt_length, clamp_max_tokens)
from kvengine.metrics.prometheus import CONTENT_TYPE
from kvengine.entrypoints.protocol import (APIError, GenerationRequest, bad, new_id, now_s, parse_chat, parse_completion,
                       parse_json, render_chat, usage)
from kvengine.core.request import RequestStatus

log = logging.getLogger("kvengine.entrypoints.server")


class Detokenizer:
    """Incremental decoding that never emits half a UTF-8 character (vLLM's offsets)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""


@dataclass
class Choice:
    index: int
    engine_id: str
    detokenizer: Detokenizer
    text: str = ""
    num_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Generation:
    """One HTTP request's engine requests (prompts x n), and their merged event stream."""

    def __init__(self, server: "ServerState", req: GenerationRequest):
        self.server = server
        self.req = req
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.choices: list[Choice] = []
        self.prompt_tokens = 0
        self.closed = False  # aborted what was left: nothing more is sent for it

    def start(self) -> None:
        """Check every prompt first (a 400 must come before any streaming), then submit."""
        tok = self.server.tokenizer
        max_len = self.server.engine.info.config.max_model_len
        req = self.req
        check_max_tokens(req.max_tokens, max_len, req.max_tokens_param)
        if any(t < 0 or t >= tok.vocab_size for t in req.stop_token_ids):
            raise bad("stop_token_ids", f"stop_token_ids must be in [0, {tok.vocab_size})")
        encoded = []
        for i, prompt in enumerate(req.prompts):
            ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise bad("prompt", f"prompt {i}: the decoder prompt cannot be empty")
            check_prompt_length(len(ids), max_len)
            if any(t < 0 or t >= tok.vocab_size for t in ids):
                raise bad("prompt", f"prompt {i}: token ids must be in [0, {tok.vocab_size})")
            encoded.append((ids, clamp_max_tokens(len(ids), req.max_tokens, max_len)))
        check_capacity(len(encoded) * req.n, self.server.engine.num_unfinished, self.server.limits, req.n)
        base = new_id("req")
        for i, (ids, max_tokens) in enumerate(encoded):
            self.prompt_tokens += len(ids)
            for j in range(self.req.n):
                index = i * self.req.n + j
                choice = Choice(index, f"{base}-{index}", Detokenizer(tok), prompt_tokens=len(ids))
                self.choices.append(choice)
                try:
                    self.server.engine.add(choice.engine_id, ids, self.req.sampling_params(max_tokens, j),
                                           self.events, index)
                except RuntimeError as err:  # the core died under us
                    raise APIError(503, str(err)) from None

    async def deltas(self):
        """Yield (choice, new text) until every choice is done; stop strings end a choice."""
        pending = len(self.choices)
        while pending:
            event = await self.events.get()
            choice = self.choices[event.index]
            if choice.done:
                continue  # a stop string already ended it
            if event.error:
                raise APIError(event.status, event.error)
            delta = ""
            if event.token_id is not None:
                choice.num_tokens += 1
                delta = choice.detokenizer.add(event.token_id)
                delta = self._apply_stop(choice, delta)
            if event.finish_reason and not choice.done:
                choice.finish_reason = event.finish_reason
                if event.finish_reason == "stop" and choice.stop_reason is None:
                    choice.stop_reason = self._stop_token(event.token_id)
            if event.token_id is not None or choice.done:
                choice.text += delta
                yield choice, delta
            if choice.done:
                pending -= 1

    def _apply_stop(self, choice: Choice, delta: str) -> str:
        if not self.req.stop or not delta:
            return delta
        text = choice.text + delta
        start = max(0, len(choice.text) - max(map(len, self.req.stop)))
        for stop in self.req.stop:
            at = text.find(stop, start)
            if at != -1:
                choice.finish_reason, choice.stop_reason = "stop", stop
                self.server.engine.abort(choice.engine_id, RequestStatus.FINISHED_STOPPED)
                return text[:at][len(choice.text):]
        return delta

    def _stop_token(self, token_id):
        return token_id if token_id in self.req.stop_token_ids else None

    def abort_unfinished(self) -> None:
        """Abort every choice not done yet (once: later calls send nothing)."""
        if self.closed or not self.server.engine.alive:
            return  # a dead core holds nothing to free
        self.closed = True
        try:
            for choice in self.choices:
                if not choice.done:
                    self.server.engine.abort(choice.engine_id)
        except RuntimeError:  # the core died meanwhile: it holds nothing either
            pass

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)


@dataclass
class ServerState:
    engine: EngineClient
    served_model_name: str
    model_root: str
    api_key: str | None = None
    chat_template: ChatTemplate | None = None  # the checkpoint's; None: protocol.render_chat
    limits: ServerLimits = field(default_factory=ServerLimits)
    dev_mode: bool = field(default_factory=lambda: os.environ.get("VLLM_SERVER_DEV_MODE") == "1")

    def render_chat(self, messages: list[dict]) -> str:
        if self.chat_template is None:
            return render_chat(messages)
        return self.chat_template.render(messages, add_generation_prompt=True)

    @property
    def tokenizer(self):
        return self.engine.info.tokenizer

    @property
    def metrics(self):
        return self.engine.metrics


def sse(payload) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


GENERATIONS = "kvengine.generations"  # the scope key of a request's Generations


class Guard:
    """The API key and dead-engine checks, a 500 for a handler bug, and the abort of what a
    request left unfinished. Pure ASGI rather than BaseHTTPMiddleware, so its `finally` runs
    when the request's ASGI call ends, however it ends: behind BaseHTTPMiddleware a disconnect
    could leave a streaming body's generator suspended, never closed, its abort never run."""

    def __init__(self, app, state: "ServerState"):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
        generations = scope[GENERATIONS] = []
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except ClientDisconnect:
            pass  # nobody is left to answer
        except Exception as err:  # a handler bug is a 500 for that request, never a dead server
            log.exception("unhandled error on %s", scope["path"])
            if not started:
                await _error(APIError(500, f"internal error: {err!r}"))(scope, receive, send)
        finally:
            for gen in generations:
                gen.abort_unfinished()

    def refusal(self, scope) -> Response | None:
        """vLLM's --api-key guards /v1; here it also guards every route that changes state."""
        path, method, state = scope["path"], scope["method"], self.state
        guarded = method != "OPTIONS" and (path.startswith("/v1") or method not in ("GET", "HEAD"))
        if state.api_key and guarded:  # OPTIONS stays open, as vLLM's, for CORS preflights
            headers = dict((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"])
            if headers.get("authorization") != f"Bearer {state.api_key}":
                return _error(APIError(401, "Unauthorized"))
        if path.startswith("/v1") and not state.engine.alive:
            return _error(APIError(503, "The engine core is not running."))
        return None


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request to arrive, head and body:
    `read_timeout_s` from its first byte (or from the connection opening). uvicorn times
    out only an idle keep-alive connection, and any byte resets that, so a client that
    sends half a header would otherwise hold its connection, and its slot, for good."""

    read_timeout_s = REQUEST_READ_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_timer = None
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_read_timer()  # the first bytes of the next request
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm_read_timer()  # it has all arrived

    def connection_lost(self, exc) -> None:
        self._disarm_read_timer()
        super().connection_lost(exc)

    def _arm_read_timer(self) -> None:
        self._disarm_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm_read_timer(self) -> None:
        if getattr(self, "_read_timer", None) is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()  # a handler reading the body sees a disconnect


def timed_protocol(read_timeout_s: float) -> type[TimedH11Protocol]:
    """The protocol class for uvicorn's `http=`, with this read deadline."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout_s": read_timeout_s})


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(state: ServerState) -> Starlette:
    """The ASGI app: Starlette, on which vLLM's FastAPI app stands, without FastAPI's import (a
    kvengine start is mostly imports): the handlers parse their bodies themselves (protocol.py), and
    the app answers an unknown route or method as FastAPI does."""
    async def health(_: Request):
        return Response(status_code=200 if state.engine.alive else 503)

    async def version(_: Request):
        return JSONResponse({"version": __version__})

    async def load(_: Request):
        return JSONResponse({"server_load": state.engine.num_unfinished})

    async def metrics(_: Request):
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    async def models(_: Request):
        config = state.engine.info.config
        return JSONResponse({"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": now_s(), "owned_by": "vllm",
            "root": state.model_root, "parent": None, "max_model_len": config.max_model_len,
            "permission": [{"id": new_id("modelperm"), "object": "model_permission", "created": now_s(),
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}]})

    async def reset_prefix_cache(_: Request):
        ok = await asyncio.wrap_future(state.engine.reset_prefix_cache())
        if not ok:
            raise APIError(409, "The prefix cache can only be reset while no request holds KV blocks.")
        return Response(status_code=200)

    async def completions(request: Request):
        gen = _begin(request, state, parse_completion(await _json(request, state.limits)))
        if gen.req.stream:
            return _stream(_completion_chunks(state, gen))
        return await _collect(request, gen, "cmpl", lambda rid, created: {
            "id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
            "choices": [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason} for c in gen.choices],
            "usage": usage(gen.prompt_tokens, gen.completion_tokens)})

    async def chat(request: Request):
        req, _ = parse_chat(await _json(request, state.limits), state.render_chat)
        gen = _begin(request, state, req)
        if gen.req.stream:
            return _stream(_chat_chunks(state, gen))
        return await _collect(request, gen, "chatcmpl", lambda rid, created: {
            "id": rid, "object": "chat.completion", "created": created, "model": state.served_model_name,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for c in gen.choices],
            "usage": usage(gen.prompt_tokens, gen.completion_tokens)})

    routes = [_route("/health", health, "GET"), _route("/version", version, "GET"), _route("/load", load, "GET"),
              _route("/metrics", metrics, "GET"), _route("/v1/models", models, "GET"),
              _route("/v1/completions", completions, "POST"), _route("/v1/chat/completions", chat, "POST")]
    if state.dev_mode:  # vLLM registers its cache resets only in dev mode
        routes.append(_route("/reset_prefix_cache", reset_prefix_cache, "POST"))
    app = Starlette(routes=routes, exception_handlers={APIError: _api_error, HTTPException: _http_error})
    app.add_middleware(Guard, state=state)
    return app


def _route(path: str, endpoint, method: str) -> Route:
    """A route of one method, as FastAPI's: Starlette's own also answers HEAD where it answers GET."""
    route = Route(path, endpoint, methods=[method])
    route.methods.discard("HEAD")
    return route


async def _api_error(_: Request, err: APIError) -> Response:
    return _error(err)


async def _http_error(_: Request, err: HTTPException) -> Response:
    """An unknown route (404) or method (405) in FastAPI's words, as vLLM answers them."""
    if err.status_code in (204, 304) or err.status_code < 200:
        return Response(status_code=err.status_code, headers=err.headers)
    return JSONResponse({"detail": err.detail}, status_code=err.status_code, headers=err.headers)


async def _json(request: Request, limits: ServerLimits):
    return parse_json(await _body(request, limits.max_request_body_bytes))


async def _body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes before more of it is read."""
    too_large = APIError(413, f"the request body is larger than the server's limit of {limit} bytes "
                              "(--max-request-body-size)")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _begin(request: Request, state: ServerState, req: GenerationRequest) -> Generation:
    if req.model is not None and req.model != state.served_model_name:
        raise APIError(404, f"The model `{req.model}` does not exist. "
                            f"Valid aliases: {state.served_model_name}.", "model")
    check_n(req.n, state.limits)
    gen = Generation(state, req)
    request.scope[GENERATIONS].append(gen)  # before start: what it adds, the guard aborts
    gen.start()
    return gen


async def _client_gone(receive) -> None:
    """Returns once the client has disconnected (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_done_or_gone(work, receive):
    """Await `work` unless the client disconnects first (vLLM's disconnect watcher):
    (True, its result), or (False, None) with `work` cancelled."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


async def _collect(request: Request, gen: Generation, id_prefix: str, build):
    async def drain():
        async for _ in gen.deltas():
            pass

    done, _ = await _until_done_or_gone(drain(), request.receive)
    if not done:  # the client gave up: the guard aborts what it left
        return Response(status_code=499)
    return JSONResponse(build(new_id(id_prefix), now_s()))


class EventStream(StreamingResponse):
    """Server-sent events that end when the client leaves, whatever the ASGI spec version
    (from 2.4 Starlette stops listening, and a request still queued sends nothing whose
    failure would tell), and whose body generator is always closed, its `finally` run."""

    async def __call__(self, scope, receive, send):
        try:
            await _until_done_or_gone(self.stream_response(send), receive)
        except OSError:  # a write to a closed connection
            pass
        finally:
            await self.body_iterator.aclose()


def _stream(chunks) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as err:  # vLLM sends an error chunk, then [DONE]
            yield sse(err.body())
        yield "data: [DONE]\n\n"  # what the client left unfinished, the guard aborts
    return EventStream(body(), media_type="text/event-stream")


def _usage_so_far(gen: Generation) -> dict:
    return usage(gen.prompt_tokens, gen.completion_tokens)


async def _completion_chunks(state: ServerState, gen: Generation):
    rid, created, model = new_id("cmpl"), now_s(), state.served_model_name
    async for choice, delta in gen.deltas():
        chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                 "choices": [{"index": choice.index, "text": delta, "logprobs": None,
                              "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}]}
        if gen.req.continuous_usage:
            chunk["usage"] = _usage_so_far(gen)
        yield sse(chunk)
    if gen.req.include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": _usage_so_far(gen), "system_fingerprint": None})


async def _chat_chunks(state: ServerState, gen: Generation):
    rid, created, model = new_id("chatcmpl"), now_s(), state.served_model_name

    def chunk(index, delta, finish_reason=None, stop_reason=None):
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": None,
                             "finish_reason": finish_reason, "stop_reason": stop_reason}]}
        if gen.req.continuous_usage:
            body["usage"] = _usage_so_far(gen)
        return sse(body)

    for choice in gen.choices:
        yield chunk(choice.index, {"role": "assistant", "content": ""})
    async for choice, delta in gen.deltas():
        yield chunk(choice.index, {"content": delta}, choice.finish_reason, choice.stop_reason)
    if gen.req.include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": _usage_so_far(gen)})
