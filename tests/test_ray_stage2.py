"""Stage 2 on a real local Ray cluster (`kvtune search --ray`): two rounds at once on two slots, each
round on one slot, the verdict the serial race gives, a config that cannot start failing only its runs,
a resume that reruns nothing, Ctrl-C ending every server, and a --ray address with no cluster refused.

One head started here for the whole module (`cluster`: 2 CPUs and 2 fake GPUs in a temporary folder
of its own, its processes in a session of their own), stopped at the end with every process it started."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvtune[ray]')")

from kvengine.config import EngineConfig  # noqa: E402
from kvtune.cluster.pool import connect  # noqa: E402
from kvtune.cluster.target import RayTarget  # noqa: E402
from kvtune.report.sections import slots_blocks  # noqa: E402
from kvtune.search.live_runs import live_runs  # noqa: E402
from kvtune.search.objective import Objective  # noqa: E402
from kvtune.search.ranking import choose  # noqa: E402
from kvtune.search.space import load_space  # noqa: E402
from kvtune.search.stage2 import LiveConfig, LivePlan, run_stage2  # noqa: E402
from kvtune.store import Store  # noqa: E402
from kvtune.targets import EngineTarget, LiveOptions  # noqa: E402
from kvtune.workload import TraceRequest, Workload  # noqa: E402
from kvtune_cli import kvtune  # noqa: E402

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
SPACE = load_space(None, ["block_size=16", "gpu_memory_utilization=0.3,0.9", "max_num_seqs=2,64",
                          "kv_cache_dtype=auto"])
# the default serves two sequences at a time: 64 clears the burst far sooner, a gap no host noise hides
DEFAULT = {"block_size": 16, "gpu_memory_utilization": 0.9, "max_num_seqs": 2, "kv_cache_dtype": "auto"}
WIDE = DEFAULT | {"max_num_seqs": 64}
BROKEN = WIDE | {"gpu_memory_utilization": 0.3}  # llama-3-8b's weights do not fit: the server cannot start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_pids(text: str, session: int) -> list[int]:
    """The cluster's live processes: those of the session `ray start` began, and any whose command
    line holds `text` (the cluster's own temporary folder). Ray renames its agents (ray::...)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and (int(fields[3]) == session or text.encode() in cmdline):
            found.append(int(name))
    return found


def _pids_with_env(marker: str) -> list[int]:
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def cluster():
    """A head with 2 CPUs and 2 fake GPUs on a free port; the address. Its folder is short (Ray's
    socket paths have a length limit) and its own, so that the end kills exactly its processes."""
    temp = tempfile.mkdtemp(prefix="kvray-")
    port = _free_port()
    head = subprocess.Popen([RAY, "start", "--head", "--num-cpus", "2", "--num-gpus", "2", "--port", str(port),
                             "--include-dashboard=false", "--dashboard-port", str(_free_port()),
                             "--temp-dir", temp, "--disable-usage-stats"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = head.communicate(timeout=120)
        assert head.returncode == 0, out
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _cluster_pids(temp, head.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 2
            while _cluster_pids(temp, head.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        left = _cluster_pids(temp, head.pid)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"the cluster's processes outlived it: {left}"


def _workload() -> Workload:
    return Workload([TraceRequest(i / 40.0, 200, 4) for i in range(8)])


def _target(**env) -> EngineTarget:
    options = LiveOptions(scrape_interval_s=0.25, watch_interval_s=0.25, device="l4-24gb")
    return EngineTarget(options=options, executor="sim", preset="llama-3-8b", device="l4-24gb", env=env,
                        extra_args="--max-model-len 4096")


def _race(db: str, study: str, candidates: list[dict], run, pool=None, target=None):
    target = target or _target()
    configs = [LiveConfig("default" if p == DEFAULT else f"trial {i}", -1 if p == DEFAULT else i, p)
               for i, p in enumerate(candidates)]
    plan = LivePlan(repeats=2, max_repeats=2)
    outcomes = run_stage2(run, configs, SPACE, EngineConfig(), _workload(), Objective("throughput", ()),
                          Store(db), study, plan, pool=pool)
    return outcomes


def _figures_verdict(db: str, study: str):
    """The one ranking's verdict on the stored runs' figures, their doubts aside: on this machine's two
    cores two slots time each other (a doubt the runs rightly carry), and the figures are what compare."""
    runs = [m for m in live_runs(Store(db), study, ()) if m.ok]
    for m in runs:
        m.doubts = []
    return choose([], runs, [], DEFAULT)[0]


def test_two_slots_run_rounds_at_once_each_on_one_slot_and_agree_with_the_serial_race(cluster, tmp_path):
    db = f"sqlite:///{tmp_path}/s.db"
    target = _target()
    pool = RayTarget(target, connect(cluster, 1))
    assert pool.size == 2
    outcomes = _race(db, "par", [DEFAULT, WIDE, BROKEN], pool.run, pool=pool)
    done = [o for o in outcomes if o.error is None]
    failed = [o for o in outcomes if o.error is not None]
    assert {o.candidate.params["max_num_seqs"] for o in done} == {2, 64}
    # every run of the config whose server cannot start failed with the server's reason; the others went on
    assert failed and all(o.candidate.params == BROKEN and "do not fit" in o.error for o in failed)
    stored = {o.run_id: Store(db).load_run(o.run_id) for o in done}
    slots = {o.run_id: stored[o.run_id].summary["slot"] for o in done}
    by_round = {}
    for o in done:
        by_round.setdefault(o.repeat, set()).add((tuple(slots[o.run_id]["gpus"]), slots[o.run_id]["node_id"]))
    assert all(len(s) == 1 for s in by_round.values()), by_round  # a round stays on its slot
    assert by_round[1] != by_round[2]  # two slots: GPU 0 and GPU 1
    spans = {r: [(slots[o.run_id]["started"], slots[o.run_id]["ended"]) for o in done if o.repeat == r] for r in (1, 2)}
    first, second = (min(s for s, _ in spans[r]) for r in (1, 2)), (max(e for _, e in spans[r]) for r in (1, 2))
    assert max(first) < min(second), spans  # the two rounds ran at the same time
    shown = " ".join(getattr(b, "text", "") for b in slots_blocks(live_runs(Store(db), "par", ())))
    assert "on 2 slot(s) of a Ray cluster" in shown  # the report names the slots and says how it tests them

    # a resume reruns nothing that finished (a failed run is no repeat: it would run again, as serially)
    again = _race(db, "par", [DEFAULT, WIDE], pool.run, pool=pool)
    assert sorted(o.run_id for o in again) == sorted(o.run_id for o in done)

    serial_db = f"sqlite:///{tmp_path}/serial.db"
    _race(serial_db, "ser", [DEFAULT, WIDE], target.run)
    serial, parallel = _figures_verdict(serial_db, "ser"), _figures_verdict(db, "par")
    # the same leader both ways; with 2 runs each a verdict's test has a degree of freedom or two, and
    # on a loaded 2-core host the runs' spread can keep "better" from being shown, serially or not:
    # the kinds are compared where the benchmark runs more (benchmarks/parallel_stage2.py)
    assert serial.leader.params == parallel.leader.params == WIDE
    assert {serial.kind, parallel.kind} <= {"better", "keep_default"}


SIGINT_SCRIPT = textwrap.dedent("""
    import sys
    from kvengine.config import EngineConfig
    from kvtune.cluster.pool import connect
    from kvtune.search.objective import Objective
    from kvtune.targets import EngineTarget
    from kvtune.workload import TraceRequest, Workload
    target = EngineTarget(executor="sim", preset="llama-3-8b", device="l4-24gb", env={"KVTUNE_RAY_MARK": sys.argv[2]})
    pool = connect(sys.argv[1], 1)
    slow = Workload([TraceRequest(i * 0.5, 200, 8) for i in range(120)])
    config = EngineConfig(max_model_len=4096)
    pool.run_rounds(target, Objective("throughput", ()), [[config], [config]], slow, lambda *a: None)
""")


def test_ctrl_c_cancels_the_tasks_and_ends_every_server_they_started(cluster, tmp_path):
    mark = f"KVTUNE_RAY_MARK={uuid.uuid4().hex}"
    script = tmp_path / "cancel.py"
    script.write_text(SIGINT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), cluster, mark.split("=")[1]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(_pids_with_env(mark)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(_pids_with_env(mark)) >= 2, "two servers never started"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode != 0 and "KeyboardInterrupt" in out, out
        deadline = time.monotonic() + 5
        while _pids_with_env(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pids_with_env(mark), "a server outlived its cancelled task"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_ray_address_with_no_cluster_is_refused_before_anything_is_written(tmp_path):
    trace = tmp_path / "t.jsonl"
    from kvtune.workload import write_workload
    write_workload(_workload(), str(trace))
    db = tmp_path / "s.db"
    address = f"127.0.0.1:{_free_port()}"
    p = kvtune("search", "--workload", trace, "--trials", "2", "--device", "l4-24gb", "--db", f"sqlite:///{db}",
               "--study", "x", "--no-report", "--ray", address, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"--ray {address}" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not db.exists()  # the cluster is checked before the store or the study is made
