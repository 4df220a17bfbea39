"""The engine the `kvengine serve` flags describe, built in the engine core process (serve.py starts
that process with build_engine). Nothing of the HTTP frontend is imported here, so that the
spawned core loads only the engine it runs."""
from __future__ import annotations

import dataclasses
import json

from kvengine.config import ConfigError, device_preset, model_preset
from kvengine.engine.clock import WallClock
from kvengine.engine.llm_engine import LLMEngine
from kvengine.entrypoints.flags import config_from_args
from kvengine.executor.cost import CostCoefficients, check_ranges


def load_coefficients(path: str | None) -> CostCoefficients | None:
    """A JSON object of CostCoefficients fields (others keep their defaults)."""
    if path is None:
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise ConfigError(f"--cost-profile {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"--cost-profile {path}: not valid JSON ({err})") from None
    known = {f.name for f in dataclasses.fields(CostCoefficients)}
    if not isinstance(data, dict) or set(data) - known:
        raise ConfigError(f"--cost-profile {path}: expected an object with some of {', '.join(sorted(known))}")
    try:
        coefficients = CostCoefficients(**data)
        check_ranges(coefficients)
    except ValueError as err:
        raise ConfigError(f"--cost-profile {path}: {err}") from None
    return coefficients


def build_engine(args):
    """Runs in the engine core process: the engine the flags describe, its tokenizer and model name."""
    config = config_from_args(args)
    if args.executor == "sim":
        if args.model:
            raise ConfigError("--model needs --executor torch: the sim executor runs no weights")
        device = device_preset(args.device)
        model = model_preset(args.preset)
        from kvengine.model.tokenizer import ByteTokenizer
        tokenizer = ByteTokenizer(model.vocab_size)
        engine = LLMEngine(config, model, device, clock=WallClock(), record_steps=False,
                           eos_token_id=tokenizer.eos_token_id,
                           cost_coefficients=load_coefficients(args.cost_profile))
        return engine, tokenizer, model.name
    if args.cost_profile:
        raise ConfigError("--cost-profile needs --executor sim: the torch executor's steps take real time")
    from kvengine.model.hf import CheckpointError
    from kvengine.engine.torch_engine import build_torch_engine
    try:
        engine = build_torch_engine(config, preset=args.preset, model_path=args.model, device=args.device,
                                    device_memory=args.device_memory, seed=args.seed, own_process=True)
    except CheckpointError as err:  # its message starts with the folder; name the flag too
        raise ConfigError(f"--model {err}") from None
    engine.record_steps = False
    return engine, engine.executor.tokenizer, args.model or engine.model.name
