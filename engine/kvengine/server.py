"""The OpenAI-compatible HTTP server, indistinguishable from `vllm serve` to clients.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /version, GET /load, GET /metrics, POST /reset_prefix_cache.
Handlers parse and check a request, hand it to the engine core, and stream
its tokens back; a client that goes away aborts its requests.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import __version__
from .chat_template import ChatTemplate
from .client import EngineClient, Event
from .limits import check_max_tokens, check_prompt_length, clamp_max_tokens
from .metrics import CONTENT_TYPE
from .protocol import (APIError, GenerationRequest, bad, new_id, now_s, parse_chat, parse_completion,
                       render_chat, usage)
from .request import RequestStatus

log = logging.getLogger("kvengine.server")


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

    def start(self) -> None:
        """Check every prompt first (a 400 must come before any streaming), then submit."""
        tok = self.server.tokenizer
        max_len = self.server.engine.info.config.max_model_len
        req = self.req
        check_max_tokens(req.max_tokens, max_len, req.max_tokens_param)
        encoded = []
        for i, prompt in enumerate(req.prompts):
            ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise bad("prompt", f"prompt {i}: the decoder prompt cannot be empty")
            check_prompt_length(len(ids), max_len)
            if any(t < 0 or t >= tok.vocab_size for t in ids):
                raise bad("prompt", f"prompt {i}: token ids must be in [0, {tok.vocab_size})")
            encoded.append((ids, clamp_max_tokens(len(ids), req.max_tokens, max_len)))
        base = new_id("req")
        for i, (ids, max_tokens) in enumerate(encoded):
            self.prompt_tokens += len(ids)
            for j in range(self.req.n):
                index = i * self.req.n + j
                choice = Choice(index, f"{base}-{index}", Detokenizer(tok), prompt_tokens=len(ids))
                self.choices.append(choice)
                self.server.engine.add(choice.engine_id, ids, self.req.sampling_params(max_tokens, j),
                                     self.events, index)

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
        if not self.server.engine.alive:
            return  # a dead core holds nothing to free
        for choice in self.choices:
            if not choice.done:
                self.server.engine.abort(choice.engine_id)

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


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvengine", version=__version__)
    app.state.server = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError):
        return JSONResponse(APIError(400, str(err)).body(), status_code=400)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if path.startswith("/v1"):
            if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
                return JSONResponse(APIError(401, "Unauthorized").body(), status_code=401)
            if not state.engine.alive:
                return JSONResponse(APIError(503, "The engine core is not running.").body(), status_code=503)
        try:
            return await call_next(request)
        except Exception as err:  # a handler bug is a 500 for that request, never a dead server
            log.exception("unhandled error on %s", path)
            return JSONResponse(APIError(500, f"internal error: {err!r}").body(), status_code=500)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if state.engine.alive else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/load")
    async def load():
        return {"server_load": state.engine.num_unfinished}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        config = state.engine.info.config
        return {"object": "list", "data": [{
            "id": state.served_model_name, "object": "model", "created": now_s(), "owned_by": "vllm",
            "root": state.model_root, "parent": None, "max_model_len": config.max_model_len,
            "permission": [{"id": new_id("modelperm"), "object": "model_permission", "created": now_s(),
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        ok = await asyncio.wrap_future(state.engine.reset_prefix_cache())
        if not ok:
            raise APIError(409, "The prefix cache can only be reset while no request holds KV blocks.")
        return Response(status_code=200)

    @app.post("/v1/completions")
    async def completions(request: Request):
        gen = _begin(state, parse_completion(await _json(request)))
        if gen.req.stream:
            return _stream(gen, _completion_chunks(state, gen))
        return await _collect(gen, "cmpl", lambda rid, created: {
            "id": rid, "object": "text_completion", "created": created, "model": state.served_model_name,
            "choices": [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason} for c in gen.choices],
            "usage": usage(gen.prompt_tokens, gen.completion_tokens)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req, _ = parse_chat(await _json(request), state.render_chat)
        gen = _begin(state, req)
        if gen.req.stream:
            return _stream(gen, _chat_chunks(state, gen))
        return await _collect(gen, "chatcmpl", lambda rid, created: {
            "id": rid, "object": "chat.completion", "created": created, "model": state.served_model_name,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for c in gen.choices],
            "usage": usage(gen.prompt_tokens, gen.completion_tokens)})

    return app


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad(None, f"the request body is not valid JSON: {err}") from None


def _begin(state: ServerState, req: GenerationRequest) -> Generation:
    if req.model is not None and req.model != state.served_model_name:
        raise APIError(404, f"The model `{req.model}` does not exist. "
                            f"Valid aliases: {state.served_model_name}.", "model")
    gen = Generation(state, req)
    gen.start()
    return gen


async def _collect(gen: Generation, id_prefix: str, build) -> dict:
    try:
        async for _ in gen.deltas():
            pass
    finally:
        gen.abort_unfinished()  # the client went away before the answer was complete
    return build(new_id(id_prefix), now_s())


def _stream(gen: Generation, chunks) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as err:  # vLLM sends an error chunk, then [DONE]
            yield sse(err.body())
        finally:
            gen.abort_unfinished()  # also on a client disconnect (the generator is closed)
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


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
