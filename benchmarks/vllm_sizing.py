#!/usr/bin/env python3
"""Does kvtune size the KV pool of every model family as vLLM does? (issue #40)

For each shrunk family config in tests/data/sizing/ (Llama 3, Qwen3, Qwen3-MoE, Mixtral, Gemma 2,
Gemma 3, DeepSeek-V3, gpt-oss) and each tensor-parallel size the family takes, side by side:
vLLM's own sizing code on that config (tests/vllm_sizing.py vllm_sizing: vLLM's ModelConfig, its
layers' KV cache specs, get_kv_cache_configs, get_max_concurrency_for_kv_cache_config, in the
vLLM venv) and kvtune's plan (tests/test_vllm_sizing.py kvtune_sizing: hf_config + plan_memory),
for a 1 GiB pool per GPU, block size 128 and a 2,048-token max_model_len. --starts also starts
the CPU build on each family at TP 1 (dummy weights) and compares its reported pool and its
logged maximum concurrency.

    python benchmarks/vllm_sizing.py [--family NAME ...] [--starts] [--json]

Ends with {"compared", "equal", "mismatches", "rows"}; a row is {"family", "tp", "reference",
"vllm_blocks", "kvtune_blocks", "vllm_concurrency", "kvtune_concurrency", "equal"}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_vllm_sizing import MAX_MODEL_LEN, kvtune_sizing  # noqa: E402
from vllm_sizing import FAMILIES, family_dir, start_and_read, vllm_sizing  # noqa: E402

TP_SIZES = (1, 2, 4)


def compare(family: str, tp: int, starts: bool) -> list[dict]:
    rows = []
    theirs = vllm_sizing(family_dir(family), tp=tp, block_size=128, max_model_len=MAX_MODEL_LEN)
    if "error" in theirs:  # vLLM refuses this TP for this shape: kvtune must refuse it too
        try:
            kvtune_sizing(family, tp=tp, block_size=128)
            refused = False
        except ValueError:
            refused = True
        return [dict(family=family, tp=tp, reference="vLLM refuses: " + theirs["error"][:120],
                     vllm_blocks=None, kvtune_blocks=None, vllm_concurrency=None, kvtune_concurrency=None,
                     equal=refused)]
    blocks, concurrency = kvtune_sizing(family, tp=tp, block_size=128)
    rows.append(dict(family=family, tp=tp, reference="vLLM's sizing code", vllm_blocks=theirs["num_blocks"],
                     kvtune_blocks=blocks, vllm_concurrency=round(theirs["max_concurrency"], 4),
                     kvtune_concurrency=round(concurrency, 4),
                     equal=blocks == theirs["num_blocks"] and abs(concurrency - theirs["max_concurrency"]) < 1e-6))
    if starts and tp == 1:
        real = start_and_read(family_dir(family), pool_gib=1, max_model_len=MAX_MODEL_LEN)
        blocks, concurrency = kvtune_sizing(family, block_size=real["block_size"])
        rows.append(dict(family=family, tp=1, reference=f"a CPU vLLM start (block {real['block_size']})",
                         vllm_blocks=real["num_gpu_blocks"], kvtune_blocks=blocks,
                         vllm_concurrency=real["max_concurrency"], kvtune_concurrency=round(concurrency, 2),
                         equal=blocks == real["num_gpu_blocks"]
                         and abs(concurrency - (real["max_concurrency"] or 0)) < 0.01))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", action="append", choices=FAMILIES, help="only these (repeatable)")
    p.add_argument("--starts", action="store_true", help="also start the CPU build on each family at TP 1")
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    args = p.parse_args(argv)
    rows = []
    for family in args.family or FAMILIES:
        for tp in TP_SIZES:
            for row in compare(family, tp, args.starts):
                rows.append(row)
                print(f"{row['family']:12} TP {row['tp']}  {row['reference'][:44]:44} blocks vLLM "
                      f"{row['vllm_blocks']!s:>6} kvtune {row['kvtune_blocks']!s:>6}  concurrency vLLM "
                      f"{row['vllm_concurrency']!s:>9} kvtune {row['kvtune_concurrency']!s:>9}  "
                      f"{'equal' if row['equal'] else 'DIFFERENT'}", flush=True)
    equal = sum(r["equal"] for r in rows)
    print(f"{equal}/{len(rows)} equal")
    if args.json:
        print(json.dumps({"compared": len(rows), "equal": equal, "mismatches": len(rows) - equal, "rows": rows}))
    return 0 if equal == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
