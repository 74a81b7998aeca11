"""The dense backward's prediction against its measured extra peak RSS on CPU (the operator
called directly: the only way to get a dense backward on CPU). The backward's allocations are
elementwise ops, matmuls and sums, the same on CPU as on CUDA; the forward's peak is in
``logsumexp`` / ``_safe_softmax``, whose CPU kernels allocate more (measured 17.8 bytes per
score element on CPU against 13 on the H200), so the forward is checked on CUDA only
(``dense_memory_cuda.py``).

    python benchmarks/dense_memory_cpu.py            # prints the table
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import sys, torch
torch.set_num_threads(1)
from torch.nn.attention.flex_attention import create_block_mask, _identity
from torch._higher_order_ops.flex_attention import flex_attention as op
from fusionguard.dense.memory import predict_dense
dt, hq, hkv, mod = getattr(torch, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
Q, KV, D = 1024, 2048, 64
def status(name): return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(name))
q = torch.randn(1, hq, Q, D, dtype=dt, requires_grad=True)
k = torch.randn(1, hkv, KV, D, dtype=dt, requires_grad=True)
v = torch.randn(1, hkv, KV, D, dtype=dt, requires_grad=True)
bias = torch.randn(hq, Q, KV)
def add_bias(s, b, h, qi, ki, bb): return s + bb[h, qi, ki]
def double(s, b, h, qi, ki): return s * 2
bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, Q, KV, device="cpu")
score = {"identity": _identity, "bias": add_bias, "s*2": double}[mod]
extra = (bias,) if mod == "bias" else ()
out = op(q, k, v, score, bm.as_tuple(), 0.125, {}, extra, ())[0]
g = torch.randn_like(out)
open("/proc/self/clear_refs", "w").write("5"); base = status("VmRSS:")
out.backward(g)
print(status("VmHWM:") - base, predict_dense("backward", q, k, v, score, extra, ()), hq * Q * KV)
"""

CASES = [
    ("float32", 4, 4, "identity"),
    ("bfloat16", 4, 4, "identity"),
    ("bfloat16", 8, 2, "identity"),
    ("bfloat16", 4, 4, "s*2"),
    ("bfloat16", 4, 4, "bias"),
    ("float32", 4, 4, "bias"),
]


def main() -> None:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("FUSIONGUARD", None)
    lines = ["| dtype | Hq/Hkv | score_mod | measured B/elt | predicted B/elt | error |", "|---|---|---|---|---|---|"]
    for dt, hq, hkv, mod in CASES:
        p = subprocess.run([sys.executable, "-c", CHILD, dt, str(hq), str(hkv), mod], capture_output=True, text=True, env=env, timeout=600)
        if p.returncode:
            lines.append(f"| {dt} | {hq}/{hkv} | {mod} | error: {p.stderr.strip().splitlines()[-1][:80]} | | |")
            continue
        meas, pred, s = map(int, p.stdout.split())
        lines.append(f"| {dt} | {hq}/{hkv} | {mod} | {meas / s:.2f} | {pred / s:.2f} | {(pred - meas) / meas:+.1%} |")
    print("Q=1024, KV=2048, D=64, B=1; dense backward extra peak RSS per score element\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
