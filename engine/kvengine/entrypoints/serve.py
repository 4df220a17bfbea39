"""`kvengine serve`: start the engine core process (which builds the engine the flags describe:
kvengine/entrypoints/build.py), then serve it over HTTP."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from kvengine.entrypoints.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from kvengine.config import ConfigError
from kvengine.entrypoints.build import build_engine
from kvengine.entrypoints.flags import limits_from_args
from kvengine.engine.core_client import EngineClient
from kvengine.engine.core import GIL_SWITCH_INTERVAL_S
from kvengine.metrics.prometheus import EngineMetrics
from kvengine.entrypoints.server import ServerState, create_app, timed_protocol

# After the engine core dies, in-flight streams get their 503 error chunk; a connection still
# open this long after is cut, so the exit (and the supervisor's restart) comes promptly.
DEATH_GRACE_S = 5.0


def chat_template(args) -> ChatTemplate | None:
    """The --model folder's chat template (the frontend applies it, as vLLM's does)."""
    if args.executor != "torch" or not args.model:
        return None
    try:
        return load_chat_template(args.model)
    except ChatTemplateError as err:
        raise ConfigError(f"--model {args.model}: {err}") from None


def build_state(args) -> ServerState:
    """Start the engine core process the flags describe; the frontend's state around it."""
    template = chat_template(args)  # a broken template fails before the engine is built
    engine_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    engine = EngineClient(build_engine, engine_args)
    name = (args.served_model_name or [args.model or engine.info.model_name])[0]
    engine.metrics = EngineMetrics(name, engine.info,
                                   user_specified_block_size=args.block_size is not None)
    return ServerState(engine, name, engine.info.model_name, args.api_key, template,
                       limits=limits_from_args(args))


def serve(args) -> int:
    """Serve until stopped (0), or until the engine core dies (1: as vLLM's frontend on an
    EngineDeadError, unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it answering 503)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvengine.entrypoints.serve")
    state = build_state(args)
    for line in state.engine.info.memory_log_lines:
        log.info(line)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # the reader thread hands tokens on without a 5 ms wait
    server = uvicorn.Server(uvicorn.Config(
        create_app(state), host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        http=timed_protocol(args.request_read_timeout), timeout_keep_alive=args.timeout_keep_alive,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size))
    died = threading.Event()
    if os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH") != "1":
        state.engine.on_death = lambda why: _stop_on_death(server, died, why, log)
    state.engine.start()
    log.info("serving %s on http://%s:%d (executor %s, engine core pid %d)", state.served_model_name,
             args.host, args.port, args.executor, state.engine.process.pid)
    try:
        server.run()
    finally:
        state.engine.shutdown()
    return 1 if died.is_set() or not server.started else 0


def _stop_on_death(server, died: threading.Event, why: str, log) -> None:
    """From the engine client's reader thread: shut the HTTP server down, then cut it short."""
    log.error("shutting down: %s", why)
    died.set()
    server.should_exit = True
    timer = threading.Timer(DEATH_GRACE_S, lambda: setattr(server, "force_exit", True))
    timer.daemon = True
    timer.start()
