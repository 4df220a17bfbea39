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
DEMO_STUDY := demo-$(shell date +%Y%m%d-%H%M%S)

# The main job on the embedded sample: 300 requests with the Azure conv trace's
# lengths behind two shared system prompts. Stage 1: 200 trials of llama-3-8b on
# an H100 in the simulator; stage 2: the top 3 and vLLM's default on the bundled
# engine (`kvengine serve --executor sim`, real HTTP, real time). About 3 minutes.
demo: $(STAMP)
	$(VENV)/bin/kvtune search --workload $(DEMO_TRACE) --slo ttft_p95=500ms --slo tpot_p95=20ms \
		--target engine --live-head 150 --db sqlite:///reports/demo.db --study $(DEMO_STUDY) \
		--report-dir reports/$(DEMO_STUDY)
	@echo "the report: reports/$(DEMO_STUDY)/report.md (and report.html beside it)"

bench: $(STAMP)
	$(VPY) benchmarks/paged_vs_contiguous.py
	$(VPY) benchmarks/replay_speed.py
	$(VPY) benchmarks/vllm_parity.py --scenario hot256
	$(VPY) benchmarks/vllm_parity.py --scenario tight
	$(VPY) benchmarks/engine_vs_hf.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
