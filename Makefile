# `make demo` and `make test` are all a fresh machine needs.
PY      ?= python3.11
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: setup test demo bench clean promtool check-alerts

setup: $(STAMP) promtool

# promtool (Debian's prometheus package) checks dashboards/prometheus/alerts.yml;
# tests/test_alerts.py says clearly when it cannot run without it.
promtool:
	@command -v promtool >/dev/null 2>&1 || \
		{ apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || \
		  { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; } || \
		  echo "note: could not install promtool (Debian's prometheus package); the alert-rule tests will skip"; }

check-alerts: promtool
	promtool check rules dashboards/prometheus/alerts.yml
	promtool test rules dashboards/prometheus/alerts_test.yml

# torch first: pinned to the local CPU wheel, so nothing later pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP) promtool
	$(VPY) -m pytest

DEMO_TRACE := kvtune/data/demo_traces.jsonl
DEMO_OUT   := reports/demo-run.json

# Until `kvtune search` lands, the demo replays the embedded trace on the sim
# target (llama-3-8b on an H100) and writes the run.
demo: $(STAMP)
	mkdir -p reports
	$(VENV)/bin/kvtune trace stats $(DEMO_TRACE)
	$(VENV)/bin/kvtune run --target sim --workload $(DEMO_TRACE) --rate-scale 4 \
		--preset llama-3-8b --device h100-80gb --out $(DEMO_OUT)
	@echo "demo run written to $(DEMO_OUT)"

bench: $(STAMP)
	$(VPY) benchmarks/paged_vs_contiguous.py
	$(VPY) benchmarks/replay_speed.py
	$(VPY) benchmarks/vllm_parity.py --scenario hot256
	$(VPY) benchmarks/vllm_parity.py --scenario tight
	$(VPY) benchmarks/engine_vs_hf.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
