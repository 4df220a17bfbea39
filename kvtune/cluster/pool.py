"""The driver's side of a Ray cluster: connect (`connect`), run rounds of stage 2 as Ray tasks, one
slot each, as many at once as the cluster has slots (`RayPool.run_rounds`), stage 1's trials as one
task per CPU (`RayPool.run_stage1`, the tasks are `stage1.work`), one task on one slot
(`RayPool.one`: a search's first start, `kvtune calibrate --ray`'s session), and cancel them.

A slot is what one live run needs: `gpus_per_run` GPUs (the config's tensor-parallel size), or one
CPU on a cluster without GPUs. Each round is one task (`rounds.run_round`) so that a round's configs
share a node and its GPUs. Ray retries nothing: a task lost with its node fails its round's runs
with the reason Ray gives, and the stage goes on. On Ctrl-C (any exception while waiting) every
pending task is cancelled with force, and the `guard` of each ends the servers it started.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

WAIT_S = 0.5  # ray.wait's slice: a Ctrl-C is handled between slices
CANCEL_WAIT_S = 10.0  # how long a cancelled task may take to end before kvtune goes on exiting
CONNECT_TIMEOUT_S = 3.0


class PoolError(Exception):
    """No cluster to run on (`--ray` names no reachable one, or Ray is not installed): exit code 2."""


@dataclass
class RayPool:
    address: str
    size: int  # rounds that can run at once
    gpus_per_run: int  # 0: the cluster has no GPUs, a run takes one CPU
    started_here: bool = False  # `--ray local`: the cluster ends with this process
    cpus: int = 1  # stage 1's tasks that can run at once, one CPU each
    one_host: bool = True  # every node is on the machine kvtune runs on (a SQLite file reaches them all)

    @property
    def slot_text(self) -> str:
        """What one slot is: '1 GPU(s)', or one CPU on a cluster without GPUs."""
        return f"{self.gpus_per_run} GPU(s)" if self.gpus_per_run else "1 CPU (the cluster has no GPUs)"

    @property
    def describe(self) -> str:
        return f"Ray cluster {self.address}: {self.size} slot(s) of {self.slot_text}, each running one round at a time"

    def _options(self) -> dict:
        # no retries: a round run again elsewhere would mix two slots in one block
        resources = {"num_gpus": self.gpus_per_run} if self.gpus_per_run else {"num_cpus": 1}
        return resources | {"max_retries": 0, "retry_exceptions": False}

    def check(self, target, config) -> tuple[dict | None, str | None]:
        """`rounds.check` in a task: the live target's first start, on a slot of the cluster."""
        from . import rounds

        value, error = self.one(rounds.check, target, config)
        return (None, error) if error is not None else value

    def calibrate(self, target, session) -> tuple[object, str | None]:
        """`rounds.calibrate` in a task: a whole calibration session on one slot of the cluster; its
        rounds.Calibrated, or None and the reason Ray gives where the task failed as a whole."""
        from . import rounds

        return self.one(rounds.calibrate, target, session)

    def one(self, fn: Callable, *args) -> tuple[object, str | None]:
        """`fn(*args)` as one task on one slot, waited for (cancelled on Ctrl-C): (its value, None),
        or (None, the reason Ray gives) where the task failed (a lost node)."""
        import ray

        ref = ray.remote(fn).options(**self._options()).remote(*args)
        got: dict = {}
        self._wait({ref: 0}, lambda _i, value, error: got.update(value=value, error=error))
        return got["value"], got["error"]

    def run_rounds(self, target, objective, rounds_: list[list], workload,
                   on_round: Callable[[int, list | None, str | None], None]) -> None:
        """Each of `rounds_` (a list of configs) as one task; `on_round(i, runs, None)` as round i
        ends, `on_round(i, None, reason)` where its task failed as a whole."""
        import ray

        from . import rounds

        remote = ray.remote(rounds.run_round).options(**self._options())
        shared = ray.put(workload)  # once for the wave, not once per round
        refs = {remote.remote(target, objective, configs, shared): i for i, configs in enumerate(rounds_)}
        self._wait(refs, on_round)

    def run_stage1(self, job, workload, tasks: int, between: Callable[[], None]) -> list[str]:
        """`stage1.work(job, workload, i)` as `tasks` tasks of one CPU each (at most `cpus` run at once),
        the workload put in the object store once; `between()` after each of the waits' slices. The
        reasons of the tasks that failed (a lost node: the other tasks go on)."""
        import ray

        from . import stage1

        remote = ray.remote(stage1.work).options(num_cpus=1, max_retries=0, retry_exceptions=False)
        shared = ray.put(workload)
        refs = {remote.remote(job, shared, i): i for i in range(tasks)}
        failed: list[str] = []

        def on_done(i: int, _ran, error: str | None) -> None:
            if error is not None:
                failed.append(f"task {i}: {error}")

        self._wait(refs, on_done, between=between, force=False)
        return failed

    def _wait(self, refs: dict, on_done, between: Callable[[], None] | None = None, force: bool = True) -> None:
        """Wait for `refs` ({ref: i}) in slices of WAIT_S, `on_done(i, value, error)` as each ends and
        `between()` after each slice; on any exception (Ctrl-C) `cancel` them (`force`: see there)."""
        import ray
        from ray.exceptions import RayError

        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=WAIT_S)
                if between is not None:
                    between()
                for ref in ready:
                    i = refs.pop(ref)
                    try:
                        value = ray.get(ref)
                    except RayError as err:
                        on_done(i, None, task_failure(err))
                        continue
                    on_done(i, value, None)
        except BaseException:
            self.cancel(list(refs), force)
            raise

    def cancel(self, refs: list, force: bool = True) -> None:
        """Cancel `refs` and wait a while for them to end. `force`: kill their workers (their guards end
        their servers); else a KeyboardInterrupt in each task first (stage 1 fails its trial as
        interrupted, `study.Stage1.optimize`), force only for those still running after CANCEL_WAIT_S."""
        import ray

        for ref in refs:
            ray.cancel(ref, force=force)
        if refs:
            _, left = ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT_S)
            if left and not force:
                self.cancel(left, force=True)

    def close(self) -> None:
        import ray

        ray.shutdown()


def task_failure(err: BaseException) -> str:
    """A failed task's reason in a line or two: Ray's own message starts with the traceback's header."""
    text = str(err).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    name = type(err).__name__
    return f"the Ray task failed ({name}): " + " ".join(lines[-2:] if len(lines) > 2 else lines)[:500]


def connect(address: str, gpus_per_run: int) -> RayPool:
    """The cluster `--ray` names: `auto` (the one running here), `local` (a new one in this process)
    or HOST:PORT of its head; a PoolError says why not."""
    try:
        import ray
    except ImportError:
        raise PoolError("--ray needs Ray, which is not installed: pip install 'kvtune[ray]'") from None
    if address not in ("auto", "local"):
        _reachable(address)
    try:
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise PoolError(f"--ray {address}: no Ray cluster to join ({str(err).splitlines()[0][:200]})") from None
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    here = ray.util.get_node_ip_address()
    one_host = all(n["NodeManagerAddress"] == here for n in ray.nodes() if n.get("Alive"))
    per_run = gpus_per_run if gpus else 0
    size = gpus // per_run if per_run else cpus
    if size < 1:
        ray.shutdown()
        raise PoolError(f"--ray {address}: the cluster has {gpus} GPU(s) and {cpus} CPU(s), too few for one run "
                        f"of {gpus_per_run} GPU(s)")
    return RayPool(address, size, per_run, started_here=address == "local", cpus=max(cpus, 1), one_host=one_host)


def _reachable(address: str) -> None:
    """A head answers at HOST:PORT: ray.init would wait minutes for one that does not."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("ray://")
    if not host or not port.isdigit():
        raise PoolError(f"--ray {address}: expected auto, local or HOST:PORT of the cluster's head")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise PoolError(f"--ray {address}: no Ray cluster answers there ({err.strerror or err})") from None
