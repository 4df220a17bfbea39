"""The ops stack (docker-compose.yml, Dockerfile, dashboards/) checked without a Docker engine.

The compose file parses and names what exists; every service has a healthcheck or a stated
reason; ports stay on loopback; images are pinned; no secret is written in the file. promtool
checks the Prometheus configuration and parses every dashboard query. Every metric name a
dashboard query or an alert rule uses is one the bundled engine exports (a live scrape) or one
vLLM documents. And `kvtune run --locust-workers 2` drives its load through a master and two workers.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from grafana import dashboard as grafana_board
from grafana import dashboard_panels, grafana_to_promql
from serverproc import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS = ROOT / "dashboards" / "prometheus"
PROMETHEUS_YML, ALERTS_YML = PROMETHEUS / "prometheus.yml", PROMETHEUS / "alerts.yml"
GRAFANA = ROOT / "dashboards" / "grafana"
VLLM_REFERENCE = Path("/work/shared/reference/vllm.md")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed: `apt-get install -y --no-install-recommends prometheus` "
                             "(Debian/Ubuntu; `make setup` does it) or a release from https://prometheus.io/download/")

SERVICES = {"engine", "vllm", "prometheus", "grafana", "postgres", "ui", "search", "locust-master", "locust-worker"}
PROFILES = {"vllm": ["gpu"], "locust-master": ["load"], "locust-worker": ["load"]}
KV_FLAGS = ("--served-model-name", "--block-size", "--gpu-memory-utilization", "--max-num-seqs",
            "--kv-cache-dtype", "--max-model-len", "--enable-prefix-caching")
NO_HEALTHCHECK_LABEL = "kvtune.no-healthcheck"

# ----------------------------------------------------------------------------------------------
# vLLM's documented metrics, as exported (/work/shared/reference/vllm.md §1, vllm/v1/metrics/loggers.py):
# counters gain `_total`, histograms are `_bucket`/`_sum`/`_count`.
VLLM_GAUGES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc", "vllm:engine_sleep_state", "vllm:cache_config_info", "vllm:lora_requests_info",
)
VLLM_COUNTERS = (
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits", "vllm:mm_cache_queries", "vllm:mm_cache_hits", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached", "vllm:generation_tokens",
    "vllm:request_success", "vllm:corrupted_requests", "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)
VLLM_EXPORTED_AS_IS = (  # declared with `_total` already (--enable-mfu-metrics)
    "vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
    "vllm:estimated_write_bytes_per_gpu_total",
)
VLLM_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:request_prefill_kv_computed_tokens", "vllm:request_params_n", "vllm:iteration_tokens_total",
    "vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds", "vllm:kv_block_reuse_gap_seconds",
    "vllm:request_num_preemptions",  # PR branches, optional (§1); the bundled engine exports it
)
# Written in the reference only as a suffix of the name before them (`vllm:mm_cache_queries` / `_hits`).
VLLM_REFERENCE_SHORTHAND = {
    "vllm:external_prefix_cache_hits", "vllm:mm_cache_hits", "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
}


def documented_vllm_series() -> set[str]:
    names = set(VLLM_GAUGES) | set(VLLM_EXPORTED_AS_IS) | {f"{n}_total" for n in VLLM_COUNTERS}
    return names | {f"{n}{suffix}" for n in VLLM_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}


# Series that neither vLLM nor the engine exports, each with where it comes from.
OTHER_SOURCES = {
    "up": "Prometheus: scrape health of every target",
    "ALERTS": "Prometheus: one series per pending or firing alert",
    "DCGM_FI_DEV_FB_USED": "NVIDIA DCGM exporter (alerts.yml: GPUMemoryNearFull, F5)",
    "DCGM_FI_DEV_FB_FREE": "NVIDIA DCGM exporter (alerts.yml: GPUMemoryNearFull, F5)",
}

# ----------------------------------------------------------------------------------------------
# PromQL: the metric names an expression selects.

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
             "unless", "atan2", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names selected in a PromQL expression: not functions, keywords, labels or strings."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)  # range and subquery selectors
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)  # label lists
    s = re.sub(r"\boffset\s+-?\w+", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", s):
        if m.group(1).lower() not in _KEYWORDS:
            names.add(m.group(1))
    return names


def test_promql_metric_names_reads_what_a_query_selects():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (job, le) (rate(vllm:e2e_request_latency_seconds_bucket'
        '{job=~"$job", model_name=~"$model_name"}[$__rate_interval])))') == {"vllm:e2e_request_latency_seconds_bucket"}
    assert promql_metric_names(
        "kvtune:x > 1.5 * (kvtune:x offset 30m) and on (job, instance) group by (job, instance) "
        "(max_over_time(vllm:num_requests_running[1h])) unless up == 0") == {"kvtune:x", "vllm:num_requests_running", "up"}
    assert promql_metric_names('count(ALERTS{alertstate="firing", fault=~"F[0-9]+"}) or vector(1e3)') == {"ALERTS"}
    assert promql_metric_names("sum(rate(a_total[5m])) by (model_name) / ignoring(x) group_left b") == {"a_total", "b"}


# ----------------------------------------------------------------------------------------------
# The compose file, with ${VAR:-default} interpolation against .env.example.

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def compose_vars(value) -> list[tuple[str, str | None, str]]:
    """(name, operator, default-or-message) of every ${...} in the parsed file's values ($$ escapes skipped)."""
    if isinstance(value, dict):
        return [v for key, item in value.items() for v in compose_vars(key) + compose_vars(item)]
    if isinstance(value, list):
        return [v for item in value for v in compose_vars(item)]
    if not isinstance(value, str):
        return []
    text = value.replace("$$", "")
    return [(m.group(1) or m.group(4), m.group(2), m.group(3) or "") for m in _VAR.finditer(text)]


def interpolate(value, env: dict[str, str]):
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m):
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3) or ""
        if op in (":-", "-"):
            return env.get(name) or arg
        if op in (":?", "?") and not env.get(name):
            raise AssertionError(f"${{{name}}} is required: {arg}")
        return env.get(name, "")

    parts = value.split("$$")
    return "$".join(_VAR.sub(sub, p) for p in parts)


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw_compose) -> dict:
    return interpolate(raw_compose, env_example())


def test_compose_parses_and_defines_the_stack(raw_compose):
    services = raw_compose["services"]
    assert set(services) == SERVICES
    for name, svc in services.items():
        assert svc.get("profiles", []) == PROFILES.get(name, []), name
        assert "container_name" not in svc, f"{name}: a container_name stops `--scale`"
    assert set(raw_compose["volumes"]) >= {v.split(":")[0] for svc in services.values()
                                            for v in svc.get("volumes", []) if not v.startswith((".", "/"))}


def test_docker_compose_config_accepts_the_file():
    """The real schema check where the compose plugin exists (it needs no Docker engine)."""
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True,
                                        check=False).returncode:
        pytest.skip("the `docker compose` plugin is not installed (only the structure is checked here)")
    for profile in ([], ["--profile", "gpu", "--profile", "load"]):
        done = subprocess.run([docker, "compose", "--env-file", str(ENV_EXAMPLE), "-f", str(COMPOSE), *profile,
                               "config", "--quiet"], capture_output=True, text=True, cwd=ROOT, check=False)
        assert done.returncode == 0, done.stderr


def test_no_secrets_in_the_compose_file_and_every_variable_in_env_example(raw_compose):
    example = env_example()
    used = compose_vars(raw_compose)
    assert {name for name, _, _ in used} <= set(example), "variables missing from .env.example"
    required = {name for name, op, _ in used if op in (":?", "?")}
    assert required == {"POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD"}
    secretish = re.compile(r"PASSWORD|TOKEN|SECRET|API_KEY")
    # With every secret variable set to a marker, a URL's password must be a marker: it comes from .env.
    marked = example | {key: f"marker-{key}" for key in example if secretish.search(key)}
    for name, svc in raw_compose["services"].items():
        env = svc.get("environment", {})
        env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
        for key, value in env.items():
            if secretish.search(key):
                assert re.fullmatch(r"\$\{[A-Z_]+(:?[-?][^}]*)?\}", str(value)), f"{name}: {key} is written in the file"
            for m in re.finditer(r"://[^:/@\s]+:([^@\s]*)@", str(interpolate(value, marked))):
                assert m.group(1).startswith("marker-"), f"{name}: {key} has a password written in a URL"
    for key, value in example.items():
        if secretish.search(key):
            assert value in ("", "change-me"), f".env.example: {key} must be a placeholder"
    assert re.search(r"^\.env$", (ROOT / ".dockerignore").read_text(), re.MULTILINE), ".env must stay out of the image"


def test_build_contexts_and_mounted_files_exist(compose):
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), f"{name}: build context {context}"
            dockerfile = context / (build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile}"
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: mounted {source} does not exist"
    # What the Dockerfile copies is in the context and not excluded by .dockerignore.
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY"):
            for source in line.split()[1:-1]:
                if not source.startswith("--"):
                    assert (ROOT / source).exists() and source not in ignored, f"Dockerfile: COPY {source}"


def test_every_service_has_a_healthcheck_or_a_reason(compose):
    for name, svc in compose["services"].items():
        check = svc.get("healthcheck")
        if check and not check.get("disable"):
            assert check["test"][0] in ("CMD", "CMD-SHELL"), name
            assert "start_period" in check and "interval" in check, name
        else:
            reason = svc.get("labels", {}).get(NO_HEALTHCHECK_LABEL, "")
            assert len(reason) > 20, f"{name}: no healthcheck and no {NO_HEALTHCHECK_LABEL} label saying why"
    # Services that need another one healthy wait for it.
    for name, svc in compose["services"].items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond["condition"] == "service_healthy", f"{name} -> {dep}"
            assert not compose["services"][dep].get("healthcheck", {}).get("disable"), f"{name} waits on {dep}"


def test_published_ports_are_on_loopback(compose):
    published = {}
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            host_ip, _, container_port = str(port).rsplit(":", 2)
            assert host_ip == "127.0.0.1", f"{name}: {port}"
            published[name] = container_port
    assert set(published) == {"engine", "vllm", "prometheus", "grafana", "postgres", "ui", "locust-master"}
    host_ports = [str(p).rsplit(":", 2)[1] for svc in compose["services"].values() for p in svc.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"


def test_images_are_pinned_to_exact_versions(raw_compose, compose):
    pinned = re.compile(r"^[\w./-]+:v?\d+\.\d+(\.\d+)?(-[\w.]+)?$")
    for name, svc in compose["services"].items():
        image = svc["image"]
        assert pinned.match(image), f"{name}: {image} is not pinned to a version"
    kvtune_images = {svc["image"] for svc in compose["services"].values() if "build" in svc}
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert kvtune_images == {f"kvtune:{version}"}
    bases = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    assert bases and all(re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", base) for base in bases), bases


def test_dockerfile_installs_cpu_torch_before_the_project():
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    torch = next(i for i, line in enumerate(lines)
                 if "pip install" in line and f"torch=={pin}" in line
                 and "--index-url https://download.pytorch.org/whl/cpu" in line)
    project = next(i for i, line in enumerate(lines) if re.search(r"pip install /app\b", line))
    assert torch < project
    assert all("cu1" not in line and "nvidia" not in line.lower() for line in lines if "pip install" in line)


def test_engine_and_vllm_take_the_same_kv_flags(compose):
    def flags(cmd):
        out = {}
        for i, arg in enumerate(cmd):
            if arg in KV_FLAGS:
                nxt = cmd[i + 1] if i + 1 < len(cmd) else ""
                out[arg] = None if nxt.startswith("--") or not nxt else nxt
        return out

    engine, vllm = compose["services"]["engine"], compose["services"]["vllm"]
    assert flags(engine["command"]) == flags(vllm["command"])
    assert set(flags(engine["command"])) == set(KV_FLAGS)
    assert vllm["entrypoint"] == ["vllm", "serve"]
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def _parse(parser, argv):
    try:
        return parser.parse_args(argv)
    except SystemExit as err:
        raise AssertionError(f"the CLI rejects {' '.join(argv)} (exit {err.code})") from None


def test_compose_commands_parse_with_kvtune_and_kvengine(compose):
    from kvengine.entrypoints.cli import build_parser as kvengine_parser

    from kvtune.cli import build_parser as kvtune_parser

    services = compose["services"]
    engine = services["engine"]["command"]
    assert engine[0] == "kvengine"
    args = _parse(kvengine_parser(), engine[1:])
    assert (args.command, args.host, args.port, args.executor) == ("serve", "0.0.0.0", 8000, "sim")
    search = services["search"]["command"]
    assert search[0] == "kvtune"
    args = _parse(kvtune_parser(), search[1:])
    assert args.target == "none" and args.no_report and args.db is None  # the store comes from $KVTUNE_DB
    for name in ("search", "ui"):
        assert services[name]["environment"]["KVTUNE_DB"].startswith("postgresql://")
        assert "@postgres:5432/" in services[name]["environment"]["KVTUNE_DB"]
    # Paths inside the image (the Dockerfile copies kvtune/ to /app/kvtune).
    assert (ROOT / args.workload.replace("/app/", "", 1)).is_file(), args.workload
    for name in ("locust-master", "locust-worker"):
        cmd = services[name]["command"]
        locustfile = cmd[cmd.index("-f") + 1]
        assert locustfile == "/app/kvtune/locustfile.py" and (ROOT / "kvtune" / "locustfile.py").is_file()
        assert cmd[cmd.index("--kvtune-shards") + 1] == env_example()["LOCUST_WORKERS"]
    master = services["locust-master"]["command"]
    assert master[master.index("--expect-workers") + 1] == env_example()["LOCUST_WORKERS"]

    def kvtune_flags(cmd):
        return {arg: cmd[i + 1] for i, arg in enumerate(cmd) if arg.startswith("--kvtune-")}

    # Locust sends the master's custom options to its workers, overriding theirs: keep them equal,
    # so a worker started by hand with the compose file's flags does what the master says anyway.
    assert kvtune_flags(master) == kvtune_flags(services["locust-worker"]["command"])
    assert {"--kvtune-workload", "--kvtune-shards", "--kvtune-samples", "--kvtune-model"} <= set(kvtune_flags(master))
    assert str(services["locust-worker"]["deploy"]["replicas"]) == env_example()["LOCUST_WORKERS"]
    ui = services["ui"]["command"]
    parser = kvtune_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    if "ui" not in commands:
        pytest.skip("`kvtune ui` is not in the CLI yet; compose runs: " + " ".join(ui))
    args = _parse(parser, ui[1:])
    assert (args.host, args.port) == ("0.0.0.0", 8501)


# ----------------------------------------------------------------------------------------------
# Prometheus and Grafana.

def test_prometheus_scrapes_the_compose_services_and_loads_the_alerts(compose):
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    services = compose["services"]
    targets = {}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets[job["job_name"]] = (host, port)
                if host != "localhost":
                    assert host in services, f"job {job['job_name']}: {host} is not a compose service"
                    ports = {str(p).rsplit(":", 1)[1] for p in services[host].get("ports", [])}
                    assert port in ports or host == "grafana", f"{target}: not the service's port"
    assert targets["engine"] == ("engine", "8000") and targets["vllm"] == ("vllm", "8000")
    mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"] if v.startswith("."))
    container_config = mounts["./dashboards/prometheus/prometheus.yml"]
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS / rule_file).is_file()
        assert mounts[f"./dashboards/prometheus/{rule_file}"] == str(Path(container_config).parent / rule_file)
    assert f"--config.file={container_config}" in services["prometheus"]["command"]


@needs_promtool
def test_promtool_check_config():
    done = subprocess.run([PROMTOOL, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_provisioning_points_at_the_stack(compose):
    grafana = compose["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("."))
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    [ds] = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"]
    scrape = yaml.safe_load(PROMETHEUS_YML.read_text())["global"]["scrape_interval"]
    assert ds["jsonData"]["timeInterval"] == scrape  # so $__rate_interval spans enough scrapes
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvtune.yml").read_text())["providers"]
    path = providers[0]["options"]["path"]
    assert mounts["./dashboards/grafana/kvtune.json"] == f"{path}/kvtune.json"
    assert mounts["./dashboards/grafana/provisioning/datasources"] == "/etc/grafana/provisioning/datasources"
    assert mounts["./dashboards/grafana/provisioning/dashboards"] == "/etc/grafana/provisioning/dashboards"
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{path}/kvtune.json"




def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and template-variable query."""
    out = [(p["title"], t["expr"]) for p in dashboard_panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            out.append((f"variable {var['name']}", m.group(1) if m else query))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return grafana_board()


def test_dashboard_has_vllms_panels_the_kv_cache_and_the_alerts(dashboard):
    titles = {p["title"] for p in dashboard_panels(dashboard)}
    vllm_standard = {"E2E Request Latency", "Time To First Token Latency", "Inter Token Latency", "Token Throughput",
                     "Scheduler State", "KV Cache Usage", "Finish Reason", "Queue Time",
                     "Requests Prefill and Decode Time", "Request Prompt Length", "Request Generation Length"}
    kvtune_extras = {"Prefix Cache Hit Rate", "Preemption Rate", "Free and Cached KV Blocks",
                     "Fault-card alert state", "Active fault-card alerts"}
    assert vllm_standard | kvtune_extras <= titles
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "model_name" in variables and "label_values(" in variables["model_name"]["definition"]
    assert variables["datasource"]["type"] == "datasource"
    queries = dashboard_queries(dashboard)
    exprs = " ".join(q for _, q in queries)
    for needed in ("vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "kvengine:num_free_blocks",
                   "kvengine:num_cached_blocks", "ALERTS", "histogram_quantile(0.99"):
        assert needed in exprs
    for panel in dashboard_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == panel["datasource"]
            if "vllm:" in t["expr"] and "cache_config_info" not in t["expr"]:
                assert 'model_name=~"$model_name"' in t["expr"], (panel["title"], t["expr"])
    ids = [p["id"] for p in dashboard_panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells = set()  # no two panels overlap on the 24-column grid
    for p in dashboard_panels(dashboard):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine


@needs_promtool
def test_promtool_parses_every_dashboard_query(dashboard, tmp_path):
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(dashboard_queries(dashboard))]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


# ----------------------------------------------------------------------------------------------
# Metric names against a live scrape of the bundled engine.

@pytest.fixture(scope="module")
def engine_series() -> set[str]:
    """Every sample name the engine's /metrics exports, after a few requests (histograms filled)."""
    from prometheus_client.parser import text_string_to_metric_families

    server = ServerProcess("--executor", "sim", "--preset", "llama-3-8b", "--device", "h100-80gb")
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        prompt = "You are a helpful assistant. " * 20
        for i in range(3):  # the shared prefix gives prefix-cache hits too
            resp = httpx.post(server.url + "/v1/completions", timeout=30,
                              json={"model": model, "prompt": prompt + f"question {i}", "max_tokens": 4})
            assert resp.status_code == 200, resp.text
        text = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert "vllm:e2e_request_latency_seconds_bucket" in names and "vllm:prefix_cache_hits_total" in names
    return names


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS_YML.read_text())["groups"] for rule in group["rules"]]


def test_every_query_uses_scraped_or_documented_metric_names(engine_series, dashboard):
    recorded = {rule["record"] for rule in alert_rules() if "record" in rule}
    known = engine_series | documented_vllm_series() | set(OTHER_SOURCES)
    unknown = []
    for where, expr in dashboard_queries(dashboard):
        unknown += [(f"dashboard: {where}", name) for name in promql_metric_names(expr) - known]
    for rule in alert_rules():
        where = f"alerts.yml: {rule.get('alert') or rule.get('record')}"
        unknown += [(where, name) for name in promql_metric_names(rule["expr"]) - known - recorded]
    assert not unknown, unknown
    # The dashboard does not lean on recording rules: it works where alerts.yml is not loaded.
    for where, expr in dashboard_queries(dashboard):
        assert not promql_metric_names(expr) & recorded, where


def test_the_engine_exports_only_documented_vllm_names(engine_series):
    ours = {name for name in engine_series if name.startswith("vllm:") and not name.endswith("_created")}
    assert ours - documented_vllm_series() == set()


def test_the_documented_list_matches_the_vllm_reference():
    if not VLLM_REFERENCE.is_file():
        pytest.skip(f"{VLLM_REFERENCE} is not on this machine")
    text = VLLM_REFERENCE.read_text()
    section = text.split("## 1.", 1)[1].split("\n## 2.", 1)[0]
    names = set(VLLM_GAUGES) | set(VLLM_COUNTERS) | set(VLLM_HISTOGRAMS) | set(VLLM_EXPORTED_AS_IS)
    missing = {n for n in names - VLLM_REFERENCE_SHORTHAND if f"`{n}`" not in section and f"`{n}" not in section}
    assert not missing
    for gone in ("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"):  # removed from vLLM
        assert gone not in documented_vllm_series()


# ----------------------------------------------------------------------------------------------
# Scaling out the load: a Locust master and two workers.

@pytest.mark.slow
def test_kvtune_run_drives_the_load_through_a_locust_master_and_two_workers(tmp_path):
    from kvtune.workload import SynthSpec, parse_dist, synthesize, write_workload

    workload = synthesize(SynthSpec(num_requests=30, rate=30.0, input_len=parse_dist("100-300"),
                                    output_len=parse_dist("8-16"), system_prompts=1, system_prompt_len=128, seed=3))
    trace = tmp_path / "t.jsonl"
    write_workload(workload, str(trace))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(scratch))
    p = subprocess.run([sys.executable, "-m", "kvtune", "run", "--target", "engine", "--executor", "sim",
                        "--preset", "llama-3-8b", "--device", "h100-80gb", "--workload", str(trace),
                        "--locust-workers", "2", "--users", "32", "--db", f"sqlite:///{tmp_path}/runs.db", "--json"],
                       capture_output=True, text=True, timeout=180, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    n = len(workload)
    assert summary["requests"] == n and summary["completed"] == n and summary["failed"] == 0
    assert summary["server_e2e_count"] == n  # the server saw each request once
    assert summary["load_shards"] == 2  # both workers replayed their share


@pytest.mark.slow
def test_the_compose_locust_services_replay_a_trace_through_two_workers(compose, tmp_path):
    """locust-master and locust-worker's commands, run on loopback (compose names and paths swapped
    for local ones): the master waits for both workers, each replays its shard, the test ends by itself."""
    from serverproc import free_port

    from kvtune.workload import SynthSpec, parse_dist, synthesize, write_workload

    services = compose["services"]
    workload = synthesize(SynthSpec(num_requests=30, rate=30.0, input_len=parse_dist("100-300"),
                                    output_len=parse_dist("8-16"), seed=5))
    trace = tmp_path / "t.jsonl"
    write_workload(workload, str(trace))
    server = ServerProcess("--executor", "sim", "--preset", "llama-3-8b", "--device", "h100-80gb",
                           "--served-model-name", env_example()["SERVED_MODEL_NAME"])
    port = str(free_port())
    swap = {services["locust-master"]["command"][services["locust-master"]["command"].index("--kvtune-workload") + 1]:
            str(trace), "http://engine:8000": server.url, "0.0.0.0": "127.0.0.1", "locust-master": "127.0.0.1",
            "5557": port}

    def local(cmd):
        cmd = [swap.get(arg, arg).replace("/app/kvtune/", f"{ROOT}/kvtune/").replace("/data/samples/", f"{tmp_path}/")
               for arg in cmd]
        assert cmd[0] == "locust"
        return [sys.executable, "-m", *cmd]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = []
    try:
        master = subprocess.Popen(local(services["locust-master"]["command"]), cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(master)
        procs += [subprocess.Popen(local(services["locust-worker"]["command"]), cwd=tmp_path, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
        log, _ = master.communicate(timeout=120)
        for p in procs[1:]:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop()
    assert master.returncode == 0, log[-3000:]
    assert "2 workers connected" in log
    shards = sorted(tmp_path.glob("samples.*.jsonl"))
    assert [s.name for s in shards] == ["samples.0.jsonl", "samples.1.jsonl"]
    samples = []
    for k, path in enumerate(shards):
        mine = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        assert mine and all(s["index"] % 2 == k for s in mine)
        samples += mine
    assert sorted(s["index"] for s in samples) == list(range(len(workload)))
    assert all(s["error"] is None and s["status"] == 200 for s in samples)
    assert (tmp_path / "locust.json").is_file()
