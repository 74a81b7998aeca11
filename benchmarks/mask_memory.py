"""fusionguard's estimate of an eager ``create_block_mask`` against its measured extra peak.

Each case runs in a fresh subprocess (no other allocation in between): eager and compiled
(``torch.compile(create_block_mask)``), causal and a document mask, 3 sizes. On CPU the peak is
the process's peak RSS (``VmHWM``, reset first through ``/proc/self/clear_refs``: ``ru_maxrss``
keeps the parent's peak across fork+exec); on CUDA ``torch.cuda.max_memory_allocated``.

    python benchmarks/mask_memory.py                      # CPU, 4096 / 8192 / 16384
    python benchmarks/mask_memory.py --device cuda --sizes 16384 32768 65536
    python benchmarks/mask_memory.py --md benchmarks/RESULTS-mask-memory.md   # append the table

Prints a compact table last; ``--md`` appends it under a heading with date, device, versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from torch.nn.attention.flex_attention import create_block_mask
from fusionguard.dense.memory import mask_build_bytes
n, kind, how, device = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
doc = (torch.arange(n, device=device) // 1000)
def causal(b, h, q, kv): return q >= kv
def document(b, h, q, kv): return (doc[q] == doc[kv]) & (q >= kv)
fn = causal if kind == "causal" else document
build = torch.compile(create_block_mask) if how == "compiled" else create_block_mask
build(fn, 1, 1, 1024, 1024, device=device)  # warm-up (and the compile, for "compiled")
def status(name):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(name))
if device == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
else:
    open("/proc/self/clear_refs", "w").write("5"); base = status("VmRSS:")
mask = build(fn, 1, 1, n, n, device=device)
if device == "cuda":
    torch.cuda.synchronize(); peak = torch.cuda.max_memory_allocated() - base
else:
    peak = status("VmHWM:") - base
print(json.dumps({"n": n, "kind": kind, "how": how, "measured": peak, "estimate": mask_build_bytes(1, 1, n, n)}))
"""


def run(n: int, kind: str, how: str, device: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x), "OMP_NUM_THREADS": "1"}
    env.pop("FUSIONGUARD", None)
    p = subprocess.run([sys.executable, "-c", CHILD, str(n), kind, how, device], capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        return {"n": n, "kind": kind, "how": how, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def table(rows: list) -> str:
    lines = ["| Q=KV | mask_mod | build | estimate (eager) | measured extra peak | estimate / measured |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['n']} | {r['kind']} | {r['how']} | | error: {r['error'][:80]} | |")
            continue
        ratio = r["estimate"] / r["measured"] if r["measured"] > 0 else float("nan")
        shown = f"{ratio:.2f}" if r["how"] == "eager" else "(not estimated: compiled)"
        lines.append(f"| {r['n']} | {r['kind']} | {r['how']} | {r['estimate'] / 1e9:.3f} GB | {r['measured'] / 1e9:.3f} GB | {shown} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--kinds", nargs="+", default=["causal", "document"])
    ap.add_argument("--compiled", action="store_true", help="also measure torch.compile(create_block_mask)")
    ap.add_argument("--md", help="append the table to this markdown file")
    args = ap.parse_args()
    rows = []
    for n in args.sizes:
        for kind in args.kinds:
            for how in ("eager", "compiled") if args.compiled else ("eager",):
                rows.append(run(n, kind, how, args.device))
                print(json.dumps(rows[-1]), flush=True)
    import torch

    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    head = f"## {datetime.date.today()}: {where}, torch {torch.__version__}, Python {platform.python_version()}"
    out = head + "\n\n" + table(rows) + "\n"
    print(out)
    if args.md:
        with open(args.md, "a") as f:
            f.write("\n" + out)


if __name__ == "__main__":
    main()
