"""benchmarks/suite_cpu.py: a pytest run's processes, their CPU summed by component."""
import json
import os
import subprocess
import sys

from benchscript import BENCHMARKS, load_benchmark

suite_cpu = load_benchmark("suite_cpu")
Process, classify = suite_cpu.Process, suite_cpu.classify

BENCH = BENCHMARKS / "suite_cpu.py"

# A test whose child Python spends about one CPU-second (its arguments name kvengine: not what it
# runs), and a test that fails.
TESTS = '''
import subprocess, sys

def test_busy_child():
    code = "import time; end = time.process_time() + 1.0\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", code, "-m", "kvengine", "serve"], check=True)

def test_fails():
    assert 1 == 2
'''


def test_components_come_from_the_program_and_a_spawned_child_takes_its_parents():
    processes = [Process(10, 1, "/r/.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model /tmp/pytest-of-x/m", 5),
                 Process(11, 10, "/r/.venv-vllm/bin/python -B -c from multiprocessing.spawn import spawn_main", 7),
                 Process(12, 1, "/r/.venv/bin/python -m kvengine serve --cost-profile /tmp/pytest-of-x/test_ray0/p.json", 1),
                 Process(13, 12, "/r/.venv/bin/python -c from multiprocessing.spawn import spawn_main", 2),
                 Process(14, 1, "/r/.venv/bin/kvtune search --workload /tmp/pytest-of-x/t.jsonl", 3),
                 Process(15, 1, "python -c import sys;exec(eval(sys.stdin.readline()))", 4),
                 Process(16, 1, "/r/.venv/bin/python /r/.venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py", 1),
                 Process(17, 1, "/usr/lib/chromium/chromium --headless", 1)]
    classify(processes)
    assert [p.component for p in processes] == [
        "vLLM API server", "vLLM engine core", "kvengine serve", "kvengine engine core", "kvtune search",
        "pytest", "Ray", "Chromium"]


def test_a_runs_children_are_found_and_a_failing_run_passes_pytests_exit_status_on(tmp_path):
    (tmp_path / "test_two.py").write_text(TESTS)
    p = subprocess.run([sys.executable, str(BENCH), "--json", "--", "-q", "-p", "no:cacheprovider", "test_two.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr + p.stdout  # pytest's: one test failed
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["pytest_rc"] == 1
    other = out["by_component"]["other Python"]  # `python -c ...`, whatever its arguments say
    assert other["cpu_s"] >= 0.8 and other["processes"] >= 1, out
    assert "kvengine serve" not in out["by_component"] and out["by_component"]["pytest"]["cpu_s"] > 0
    assert abs(out["sampled_cpu_s"] - sum(c["cpu_s"] for c in out["by_component"].values())) < 0.5
    # /proc/stat counts in clock ticks: on a short run beside a busy suite the share may pass 1 by a
    # tick of each CPU at either end (and busy is rounded to 3 places)
    ticks = 2 / (os.sysconf("SC_CLK_TCK") * out["wall_s"])
    assert out["host_cpu_s"] >= 0.8 and 0 < out["busy"] <= 1.0 + ticks + 0.0005


def test_the_default_run_is_make_tests_pytest_line():
    makefile = (BENCHMARKS.parent / "Makefile").read_text()
    plugins = makefile.split("PYTEST_PLUGINS := ", 1)[1].split("\n", 1)[0].split()
    [line] = [ln.strip() for ln in makefile.splitlines() if " -m pytest $(PYTEST_PLUGINS) " in ln]
    env, _, args = line.partition(" $(VPY) -m pytest $(PYTEST_PLUGINS) ")
    assert dict([env.split("=")]) == suite_cpu.MAKE_TEST_ENV
    assert plugins + args.split() == suite_cpu.MAKE_TEST_ARGS
