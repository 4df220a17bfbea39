"""`--ray ADDRESS` of `kvtune search`, `kvtune run` and `kvtune calibrate`: the flag, which targets a
cluster can run, and the connection (`connect_ray`), in one place so that the three commands mean
the same by it. Ray is imported only where --ray is given (cluster.pool imports it in `connect`).

Only a server kvtune starts (engine, vllm, sglang) runs on a cluster: it starts in a Ray task on the
node Ray picks, on the GPUs Ray assigns (cluster.rounds.on_slot), never on this machine. A URL names
a server already running somewhere, and `--target sim` starts none: `--ray` is refused for them.
"""
from __future__ import annotations

from kvengine.config import ConfigError

STARTED = ("engine", "vllm", "sglang")  # the targets whose servers kvtune starts
ADDRESSES = ("auto joins the cluster running here, local starts one in this process (it ends with kvtune), "
             "HOST:PORT is its head (needs pip install 'kvtune[ray]'; docs/cluster.md)")


def add_ray_argument(group, what: str) -> None:
    """--ray ADDRESS, its help saying `what` runs on the cluster."""
    group.add_argument("--ray", metavar="ADDRESS", help=f"{what}: {ADDRESSES}")


def refuse_target(args) -> None:
    """ConfigError (exit 2, before anything starts or is stored) where --ray comes with a --target whose
    server kvtune does not start. `--target none` (a search without a live stage) starts none either,
    and needs none."""
    if args.ray and args.target not in STARTED + ("none",):
        raise ConfigError(f"--ray {args.ray}: the cluster runs the servers kvtune starts (--target "
                          f"{', '.join(STARTED)}); --target {args.target} has none")


def connect_ray(args, gpus_per_run: int):
    """The cluster --ray names (cluster.pool.RayPool), a slot `gpus_per_run` GPUs on one node (one CPU
    on a cluster without GPUs); ConfigError naming the flag where --target cannot run there
    (`refuse_target`), Ray is missing or no cluster answers. The caller closes it (`pool.close()`:
    a `--ray local` cluster ends with it)."""
    refuse_target(args)
    from ..cluster.pool import PoolError, connect

    try:
        return connect(args.ray, gpus_per_run)
    except PoolError as err:
        raise ConfigError(str(err)) from None


def on_ray(args, target, gpus_per_run: int):
    """(`target` with its servers started on the cluster (cluster.target.RayTarget), the pool)."""
    from ..cluster.target import RayTarget

    pool = connect_ray(args, gpus_per_run)
    return RayTarget(target, pool), pool
