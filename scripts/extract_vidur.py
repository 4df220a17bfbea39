"""Extract the compact tables kvtune ships from Vidur's GPU profiles (microsoft/vidur, MIT licence).

    python scripts/extract_vidur.py /path/to/vidur   # a checkout, or a bare git directory

Writes benchmarks/data/vidur/linear_ops.csv (per-layer linear and elementwise ops by device,
model, tensor-parallel size and tokens; medians in ms) and
engine/kvengine/executor/data/allreduce.csv (NCCL all-reduce within one node by interconnect,
ranks and message bytes, at sizes about sqrt(2) apart; medians in ms). See benchmarks/data/vidur/SOURCES.md.
"""
from __future__ import annotations

import csv
import io
import math
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
SHAPE = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
TOKENS = {1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
          6144, 8192, 12288, 16384}
NETWORKS = {"h100_dgx": "nvlink4", "a100_dgx": "nvlink3"}  # DGX nodes: NVSwitch between all GPUs


def read(repo: str, path: str) -> list[dict]:
    if (Path(repo) / path).exists():
        text = (Path(repo) / path).read_text()
    else:
        text = subprocess.run(["git", "--git-dir", repo, "show", f"HEAD:{path}"], capture_output=True, text=True,
                              check=True).stdout
    return list(csv.DictReader(io.StringIO(text)))


def files(repo: str) -> list[str]:
    if (Path(repo) / "data").exists():
        return [str(p.relative_to(repo)) for p in Path(repo, "data/profiling").rglob("*.csv")]
    out = subprocess.run(["git", "--git-dir", repo, "ls-tree", "-r", "--name-only", "HEAD", "data/profiling"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def linear_ops(repo: str) -> list[dict]:
    rows = []
    for path in sorted(files(repo)):
        parts = path.split("/")
        if parts[2] != "compute" or parts[-1] != "mlp.csv" or parts[3] not in ("a100", "h100"):
            continue
        device, model = parts[3], "/".join(parts[4:-1])
        groups = defaultdict(list)
        for r in read(repo, path):
            if int(r["num_tokens"]) in TOKENS:
                groups[(int(r["num_tensor_parallel_workers"]), int(r["num_tokens"]))].append(r)
        for (tp, tokens), same in sorted(groups.items()):
            row = {"device": device, "model": model, "tensor_parallel_size": tp, "num_tokens": tokens}
            row |= {k: same[0][k] for k in SHAPE}
            row |= {f"{op}_ms": round(statistics.median(float(r[f"time_stats.{op}.median"]) for r in same), 5)
                    if f"time_stats.{op}.median" in same[0] else "" for op in OPS}  # phi-2 has no 2nd norm
            rows.append(row)
    return rows


def allreduce(repo: str) -> list[dict]:
    rows = []
    for network, interconnect in NETWORKS.items():
        groups = defaultdict(list)
        for r in read(repo, f"data/profiling/network/{network}/all_reduce.csv"):
            if r["collective"] == "all_reduce" and r["devices_per_node"] == r["num_workers"]:
                groups[(int(r["num_workers"]), int(r["size"]))].append(float(r["time_stats.all_reduce.median"]))
        sizes = sorted({size for _, size in groups})
        kept = {min(sizes, key=lambda s, g=g: abs(math.log(s / g))) for g in (2048 * 2 ** (k / 2) for k in range(31))}
        rows += [{"interconnect": interconnect, "ranks": ranks, "bytes": size,
                  "median_ms": round(statistics.median(times), 5)}
                 for (ranks, size), times in sorted(groups.items()) if size in kept]
    return rows


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    repo = sys.argv[1]
    write(ROOT / "benchmarks/data/vidur/linear_ops.csv", linear_ops(repo))
    write(ROOT / "engine/kvengine/executor/data/allreduce.csv", allreduce(repo))
