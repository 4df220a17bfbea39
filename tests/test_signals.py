"""SIGINT, SIGTERM and SIGHUP at points of `kvtune run` and `kvtune search`: the command ends with
128 + the signal's number and one line, every process it started ends with it, and the store
holds no run left 'running' nor an Optuna trial left RUNNING; a resumed search measures exactly
the trials asked for."""
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import optuna
import psutil
import pytest

from kvtune.search.study import SIMPLIFIES
from kvtune.store import Store
from kvtune.workload import TraceRequest, Workload, write_workload

pytestmark = pytest.mark.slow

SIM_ENGINE = ["--target", "engine", "--executor", "sim", "--preset", "llama-3-8b", "--device", "l4-24gb"]


def start(tmp_path, *args) -> subprocess.Popen:
    """kvtune in a session of its own, as a terminal or a service manager starts it."""
    return subprocess.Popen([sys.executable, "-m", "kvtune", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(proc: subprocess.Popen, condition, timeout_s: float = 90.0):
    """Poll `condition()` until it gives something true; fail if kvtune ends or time runs out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"kvtune ended (status {proc.returncode}) before the signal point:\n{out[-2000:]}{err[-2000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the signal point was not reached in time")


def replaying(proc: subprocess.Popen) -> list[psutil.Process]:
    """kvtune's processes once a kvengine server and Locust both run (the server answered): else []."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
        lines = [" ".join(k.cmdline()) for k in kids]
    except psutil.Error:
        return []
    if any("kvengine serve" in line for line in lines) and any("locust" in line for line in lines):
        return kids
    return []


def stop_with(proc: subprocess.Popen, sig: int, kids: list[psutil.Process]) -> str:
    """Send `sig`; check the exit status, the one line, and that no process of kvtune's is left."""
    groups = {proc.pid} | {os.getpgid(k.pid) for k in kids if k.is_running()}
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtune: ") and "stopped" in lines[0], err
    _, alive = psutil.wait_procs(kids, timeout=20)
    assert not alive, [" ".join(p.cmdline()) for p in alive]
    assert not [pid for pid in psutil.pids() if _group(pid) in groups]
    return out


def shares_the_cpu_with_its_load_generator(proc: subprocess.Popen, kids: list[psutil.Process]) -> None:
    """The server runs in a process group of its own (stopped as one) but in kvtune's session, as
    Locust does: Linux's autogroup shares the CPU between sessions, so a busy server in a session
    of its own starves the load generator, whose requests then go out late."""
    server = next(k for k in kids if "kvengine serve" in " ".join(k.cmdline()))
    assert os.getpgid(server.pid) == server.pid
    assert {os.getsid(k.pid) for k in kids} == {os.getsid(proc.pid)}


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def long_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_workload(Workload([TraceRequest(i * 0.5, 64, 400) for i in range(40)]), str(trace))  # ~20 s of load
    return trace


def no_run_left_running(db: str) -> list:
    runs = Store(db).list_runs(limit=1000)
    assert not [r.id for r in runs if r.status == "running"], runs
    return runs


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_run_stopped_while_its_server_answers(tmp_path, sig):
    db = f"sqlite:///{tmp_path}/s.db"
    proc = start(tmp_path, "run", *SIM_ENGINE, "--workload", str(long_trace(tmp_path)), "--users", "64", "--db", db)
    kids = wait_for(proc, lambda: replaying(proc))
    shares_the_cpu_with_its_load_generator(proc, kids)
    stop_with(proc, sig, kids)
    (run,) = no_run_left_running(db)
    assert run.status == "failed" and run.error == f"interrupted by {signal.Signals(sig).name}"


def _complete_trials(db_path) -> int:
    try:
        with sqlite3.connect(db_path, timeout=5) as con:
            return con.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


def _running_with_heartbeat(db_path) -> bool:
    """A trial is inside its objective: RUNNING, and its heartbeat thread has beaten."""
    try:
        with sqlite3.connect(db_path, timeout=5) as con:
            return con.execute("SELECT count(*) FROM trials JOIN trial_heartbeats USING (trial_id) "
                               "WHERE trials.state = 'RUNNING'").fetchone()[0] > 0
    except sqlite3.OperationalError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_search_stopped_in_stage_1_resumes_to_exactly_the_trials_asked(tmp_path, sig):
    trace = tmp_path / "t.jsonl"
    write_workload(Workload([TraceRequest(i / 40, 1500 + (i * 37) % 500, 60) for i in range(500)]), str(trace))
    db_path, trials = tmp_path / "s.db", 6
    args = ["search", "--workload", str(trace), "--device", "l4-24gb", "--max-model-len", "4096",
            "--objective", "throughput", "--trials", str(trials), "--target", "none", "--db", f"sqlite:///{db_path}",
            "--study", "k", "--no-report"]
    proc = start(tmp_path, *args)
    wait_for(proc, lambda: _complete_trials(db_path) >= 2 and _running_with_heartbeat(db_path))
    stop_with(proc, sig, [])
    study = optuna.load_study(study_name="k", storage=f"sqlite:///{db_path}")
    assert not [t.number for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    stopped = [t for t in study.trials if t.user_attrs.get("interrupted")]  # none if it came between trials
    assert len(stopped) <= 1 and all(t.state == optuna.trial.TrialState.FAIL for t in stopped)
    for t in stopped:
        assert t.user_attrs["fail_reason"] == f"interrupted by {signal.Signals(sig).name}"
    assert not Store(f"sqlite:///{db_path}").list_trials("k")  # stage 1's one record is Optuna's

    p = subprocess.run([sys.executable, "-m", "kvtune", *args], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    study = optuna.load_study(study_name="k", storage=f"sqlite:///{db_path}")
    assert not [t.number for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    assert len(measured(study)) == trials
    runs = Store(f"sqlite:///{db_path}").list_runs(study="k", limit=1000)
    complete = {t.number for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert {r.trial_number for r in runs} <= complete  # no run of a trial that failed


def measured(study) -> list:
    """Trials that measured a config towards --trials: complete, or failed for a reason of the config's
    own (not stage 2's checks of a leader with fewer changed knobs, which come on top)."""
    def config_failed(t):
        reason = t.user_attrs.get("fail_reason")
        return reason is not None and not reason.startswith("interrupted") and not t.user_attrs.get("surplus")
    return [t for t in study.trials if t.user_attrs.get(SIMPLIFIES) is None
            and (t.state == optuna.trial.TrialState.COMPLETE
                 or (t.state == optuna.trial.TrialState.FAIL and config_failed(t)))]


def test_a_search_stopped_in_a_live_run(tmp_path):
    db = f"sqlite:///{tmp_path}/s.db"
    proc = start(tmp_path, "search", *SIM_ENGINE, "--workload", str(long_trace(tmp_path)), "--max-model-len", "4096",
                 "--trials", "2", "--top-k", "1", "--repeats", "1", "--max-repeats", "1", "--users", "64",
                 "--db", db, "--study", "live", "--no-report")
    kids = wait_for(proc, lambda: replaying(proc))
    stop_with(proc, signal.SIGINT, kids)
    no_run_left_running(db)
    study = optuna.load_study(study_name="live", storage=db)
    assert len(measured(study)) == 2
    assert not [t.number for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]


# kvtune search that sends itself signal `argv[3]` as trial 2's objective marks it started, from inside
# SQLAlchemy's reading of the trial's row (a profile hook): the handler's exception unwinds out of a
# transaction of Optuna's that holds SQLite's write lock (every one of its transactions does).
IN_A_WRITE = textwrap.dedent("""
    import os, signal, sys
    from kvtune.cli import main
    marks = []

    def hook(frame, event, _arg):
        if event == "call" and frame.f_code.co_name == "mark_started":
            marks.append(1)
        elif len(marks) == 3 and event == "call" and frame.f_code.co_name == "_make_key_to_index":
            sys.setprofile(None)
            os.kill(os.getpid(), int(sys.argv[3]))

    sys.setprofile(hook)
    sys.exit(main(["search", "--workload", sys.argv[1], "--device", "l4-24gb", "--max-model-len", "4096",
                   "--objective", "throughput", "--trials", "4", "--target", "none", "--db", sys.argv[2],
                   "--study", "k", "--no-report"]))
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_inside_a_store_write_still_ends_the_trial(tmp_path, sig):
    """The stop is recorded (trial 2 FAIL, interrupted) although it cut short a transaction that held
    the lock the record needs (the trial was left RUNNING, for no later search to count)."""
    trace, script, db = tmp_path / "t.jsonl", tmp_path / "stop.py", f"sqlite:///{tmp_path}/s.db"
    write_workload(Workload([TraceRequest(i / 40, 300 + (i * 37) % 200, 20) for i in range(60)]), str(trace))
    script.write_text(IN_A_WRITE)
    p = subprocess.run([sys.executable, str(script), str(trace), db, str(int(sig))], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 128 + sig, p.stderr  # the hook fired: else the search ends with 0
    study = optuna.load_study(study_name="k", storage=db)
    assert [(t.number, t.state.name) for t in study.trials] == [(0, "COMPLETE"), (1, "COMPLETE"), (2, "FAIL")]
    assert study.trials[2].user_attrs["fail_reason"] == f"interrupted by {signal.Signals(sig).name}"
