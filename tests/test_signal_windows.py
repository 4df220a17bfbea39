"""The windows in which a stop signal used to be lost: inside a child's start (the child outlived
kvtune), inside a destructor (Python dropped the exception; kvtune ran to the end), and between
Optuna storing a trial and the objective starting (the trial stayed RUNNING)."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kvtune.stopping import spawn


def _raise_interrupt(_signum, _frame):
    raise KeyboardInterrupt


def test_a_signal_during_a_child_start_unwinds_with_the_child_in_hand():
    previous = signal.signal(signal.SIGINT, _raise_interrupt)
    started = []

    def keep(proc):
        started.append(proc)
        os.kill(os.getpid(), signal.SIGINT)  # the child exists, spawn has not returned: the old window
        for _ in range(1000):  # where the handler would run, were the signal not held
            pass

    try:
        with pytest.raises(KeyboardInterrupt):
            spawn([sys.executable, "-c", "import time; time.sleep(30)"], keep)
    finally:
        signal.signal(signal.SIGINT, previous)
        for proc in started:
            proc.kill()
            proc.wait()
    assert len(started) == 1 and started[0].returncode == -signal.SIGKILL  # the caller could stop it


DROPPED_IN_A_DESTRUCTOR = textwrap.dedent("""
    import argparse, os, signal, sys, time
    from kvtune import cli

    class Collected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler raises here, where Python drops the exception
                pass

    def job(_args):
        Collected()
        for _ in range(300):
            time.sleep(0.01)
        print("ran to the end")
        return 0

    def parser(only=None):
        p = argparse.ArgumentParser(prog="kvtune")
        p.add_subparsers().add_parser("job").set_defaults(func=job)
        return p

    cli.build_parser = parser  # a command of the test's own, under kvtune's real signal handling
    sys.exit(cli.main(["job"]))
""")


def test_a_signal_dropped_in_a_destructor_still_stops_kvtune():
    p = subprocess.run([sys.executable, "-c", DROPPED_IN_A_DESTRUCTOR], capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, (p.stdout, p.stderr)
    assert "ran to the end" not in p.stdout
    assert p.stderr.strip().splitlines() == ["kvtune: stopped by signal 15 (SIGTERM); the servers it started are stopped"]


def test_a_signal_as_optuna_stores_a_trial_fails_that_trial(tmp_path):
    """A stop signal after Optuna stored a new trial RUNNING but before the objective began: that trial
    is failed as interrupted (a trial left RUNNING is counted by no search and rerun by none)."""
    import optuna
    from kvengine.config import EngineConfig, device_preset, model_preset

    from kvtune.search import Objective, Stage1, load_space, open_storage, open_study
    from kvtune.store import Store
    from kvtune.targets import SimTarget
    from kvtune.workload import TraceRequest, Workload

    db = f"sqlite:///{tmp_path}/s.db"
    space = load_space(None, ["block_size=16", "kv_cache_dtype=auto", "max_num_seqs=256",
                              "gpu_memory_utilization=0.80:0.95:0.01"])
    objective = Objective("throughput", ())
    study = open_study(open_storage(db), "w", objective, "tpe", 0, {"workload": "w"})
    target = SimTarget(model_preset("llama-3-8b"), device_preset("l4-24gb"))
    workload = Workload([TraceRequest(i / 10, 100, 8) for i in range(10)])
    stage1 = Stage1(study, space, EngineConfig(max_model_len=4096), objective, target.run, workload, Store(db), 3)
    create, created = study._storage.create_new_trial, []  # Optuna's storage: the moment it stores a trial

    def create_then_signal(*args, **kwargs):
        trial_id = create(*args, **kwargs)
        created.append(trial_id)
        if len(created) == 2:  # the second trial, stored RUNNING, not yet handed to the objective
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # where the handler would run, were the signal not held
                pass
        return trial_id

    study._storage.create_new_trial = create_then_signal
    previous = signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            stage1.optimize()
    finally:
        signal.signal(signal.SIGINT, previous)
    trials = optuna.load_study(study_name="w", storage=db).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL]
    assert trials[1].user_attrs["fail_reason"] == "interrupted by SIGINT" and trials[1].user_attrs["interrupted"]
