"""The copy-paste launch commands of a config, for vLLM, SGLang and the bundled kvengine.

Built by the same targets that start those servers in stage 2, so the flags
(and SGLang's mapping of vLLM's knobs) are the ones kvtune itself ran.
"""
from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

from kvengine.config import EngineConfig

from ..results import Launch
from ..targets import EngineTarget, SglangTarget, TargetStartError, VllmTarget
from ..targets.rules import CPU_KV_SPACE_ENV

MODEL_VAR = "$MODEL"
_PLACEHOLDER = "__KVTUNE_MODEL__"
_LOCAL_ONLY = ("--host", "--port", "--served-model-name")  # where kvtune ran it, not what ops should copy
# The Hugging Face checkpoint each preset's shape comes from: a starting point for $MODEL.
PRESET_MODELS = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
}


@dataclass
class LaunchCommand:
    server: str  # vLLM | SGLang | kvengine
    text: str | None  # the shell command, None when the server cannot run this config
    note: str = ""  # why not, or what to know first


def launch_commands(config: EngineConfig, preset: str | None, device: str | None,
                    served_model: str | None = None, measured: dict | None = None) -> list[LaunchCommand]:
    """vLLM (`vllm serve`, or the module form the measured vLLM ran as), SGLang and kvengine serve; `served_model` when a live run already used a real model;
    `measured`: that run's stored config, whose server environment (VLLM_CPU_KVCACHE_SPACE=...) and
    extra server arguments the command of its server must carry to reproduce what was measured."""
    model = served_model or _PLACEHOLDER
    launch = Launch.of(measured)
    env, args = (launch.env, launch.args) if launch else ({}, "")
    server_of_args = launch.server if launch else None
    vllm_args, sglang_args = (args if server_of_args == "vllm" else ""), (args if server_of_args == "sglang" else "")
    if CPU_KV_SPACE_ENV in env and "--kv-cache-memory-bytes" not in args:
        # the measured server's pool came from its environment: the byte count it reported is no flag it
        # was given, and pasted on a GPU host it would pin the pool at that size
        config = dataclasses.replace(config, kv_cache_memory_bytes=None)
    # the form the measured vLLM ran as: `python -m vllm.entrypoints.openai.api_server --model ...`
    # takes its flags as `vllm serve` does, but the operator should paste what kvtune ran
    module = launch.module if server_of_args == "vllm" else None
    vllm_command = f"python -m {module}" if module else "vllm"
    out = []
    for server, name, target, server_env in (
            ("vLLM", "vllm", VllmTarget(model=model, vllm_command=vllm_command, extra_args=vllm_args), env),
            ("SGLang", "sglang", SglangTarget(model=model, python="python", extra_args=sglang_args), {})):
        try:
            argv = _strip_local(target.command(config, 0))
        except TargetStartError as err:
            out.append(LaunchCommand(server, None, str(err)))
        else:
            prefix = [f"{k}={shlex.quote(str(v))}" for k, v in sorted(server_env.items())]
            note = (f"with {', '.join(prefix)}: the environment the measured server ran with" if prefix else "")
            out.append(LaunchCommand(server, _shell(argv, prefix), note or _untested(server_of_args, name)))
    executor = launch.executor if server_of_args == "engine" else None
    engine = EngineTarget(executor=executor or "sim", preset=preset or "llama-3-8b", device=device or "h100-80gb")
    argv = ["kvengine", *_strip_local(engine.serve_args(config, 0))]
    out.append(LaunchCommand("kvengine", _shell(argv), (
        f"the bundled engine with the {executor} executor, as it was measured" if executor else
        "the bundled engine serving the simulated device (--executor sim): the simulator that measured this "
        "config, in real time" if server_of_args is None else
        "the bundled engine serving the simulated device (--executor sim): an untested translation, "
        "kvtune measured another server")))
    return out


def _untested(measured_server: str | None, server: str) -> str:
    """The note of a command for a server other than the one measured."""
    if measured_server is None or measured_server == server:
        return ""
    return f"an untested translation of the measured config: kvtune ran {measured_server}, not this server"


def model_export(preset: str | None, served_model: str | None) -> str | None:
    """The line that sets $MODEL, when the commands use it."""
    if served_model:
        return None
    suggestion = PRESET_MODELS.get(preset or "", "/path/to/your/model")
    return f"export MODEL={shlex.quote(suggestion)}  # the checkpoint you serve (the study sized {preset})"


def _strip_local(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _LOCAL_ONLY:
            skip = True
        else:
            out.append(arg)
    return out


def _shell(argv: list[str], env: list[str] = ()) -> str:
    """One flag per line, so a reader sees each knob; pastes as one command."""
    words = [shlex.quote(a).replace(_PLACEHOLDER, f'"{MODEL_VAR}"') for a in argv]
    lines, current = [], list(env)
    for word in words:
        if word.startswith("--") and current:
            lines.append(" ".join(current))
            current = []
        current.append(word)
    lines.append(" ".join(current))
    return " \\\n    ".join(lines)
