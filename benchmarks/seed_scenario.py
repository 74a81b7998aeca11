"""The seed write-ups' scenario on a GPU: what dense costs, what strict saves, what compiled gives.

bf16, 32 q-heads / 8 kv-heads, head_dim 128, Q=2048, KV=10240, causal BlockMask, enable_gqa=True.
For each mode: forward and backward peak memory above the starting point (CUDA caching
allocator counters), and what fusionguard logged. Prints a table last; ``--json PATH`` keeps it.

    python benchmarks/seed_scenario.py [--json out.json] [--small]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard

GB = 1e9


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def peak_of(fn):
    """Peak bytes allocated above the starting point while fn runs; (peak, result, error)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # strict mode's DenseFallbackError is the expected one
        error = exc
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, result, error, time.perf_counter() - t0


def inputs(shape, requires_grad=True):
    b, hq, hkv, q_len, kv_len, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)

    def mk(h, n):
        return torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = mk(hq, q_len), mk(hkv, kv_len), mk(hkv, kv_len)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device="cuda")
    return q, k, v, mask


def run_mode(name, fa, shape, strict, guard=True, allow_forward=False):
    torch.cuda.empty_cache()
    q, k, v, mask = inputs(shape)
    if guard:
        fusionguard.enable(strict=False, log_path=False)  # forward decides its own mode below
    row = {"mode": name}
    before = len(fusionguard.events()) if guard else 0

    def fwd():
        return fa(q, k, v, block_mask=mask, enable_gqa=True)

    if guard:
        fusionguard.enable(strict=strict and not allow_forward, log_path=False)
    fpeak, out, ferr, ftime = peak_of(fwd)
    row.update(fwd_peak_gb=fpeak / GB, fwd_s=ftime, fwd_error=type(ferr).__name__ if ferr else None)
    if out is not None:
        if guard:
            fusionguard.enable(strict=strict, log_path=False)
        grad = torch.randn_like(out)
        bpeak, _, berr, btime = peak_of(lambda: out.backward(grad))
        row.update(bwd_peak_gb=bpeak / GB, bwd_s=btime, bwd_error=type(berr).__name__ if berr else None)
    if guard:
        evs = fusionguard.events()[before:]
        row["logged"] = [
            f"{e['event']}:{e.get('phase')}:{e.get('path')}:{e.get('cause') or e.get('template')}"
            for e in evs
            if e["event"] in ("flex_call", "flex_compile")
        ]
        fusionguard.disable()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--small", action="store_true", help="a quick shape for smoke runs")
    args = ap.parse_args()
    shape = (1, 32, 8, 2048, 10240, 128) if not args.small else (1, 8, 2, 256, 1024, 64)
    compiled = torch.compile(flex_attention)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": getattr(__import__("triton"), "__version__", None),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "shape(B,Hq,Hkv,Q,KV,D)": shape,
        "dtype": "bfloat16",
    }
    rows = [
        run_mode("eager, no fusionguard", flex_attention, shape, strict=False, guard=False),
        run_mode("eager, warn", flex_attention, shape, strict=False),
        run_mode("eager, strict (forward)", flex_attention, shape, strict=True),
        run_mode("eager fwd allowed, strict bwd", flex_attention, shape, strict=True, allow_forward=True),
        run_mode("compiled, no fusionguard", compiled, shape, strict=False, guard=False),
        run_mode("compiled, strict", compiled, shape, strict=True),
    ]
    # "eager fwd allowed": the forward ran in warn mode, then strict is switched on for backward.
    result = {"meta": meta, "rows": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    print(json.dumps(meta))
    print(f"{'mode':<32} {'fwd GB':>8} {'bwd GB':>8}  {'fwd err':<18} {'bwd err':<18} logged")
    for r in rows:
        fb = r.get("bwd_peak_gb")
        print(
            f"{r['mode']:<32} {r['fwd_peak_gb']:>8.3f} {fb if fb is None else f'{fb:8.3f}'!s:>8}  "
            f"{r.get('fwd_error')!s:<18} {r.get('bwd_error')!s:<18} {' '.join(r.get('logged', []))}"
        )


if __name__ == "__main__":
    main()
