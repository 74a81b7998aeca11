"""Rescue mode on a GPU, the seed scenario: eager calls and the recompile-limit slide, rescued.

For each mode: forward/backward peak memory above the start, results and gradients against the
dense run, and (varying lengths) how many compiles 20 steps cost.

    python benchmarks/rescue_seed.py [--small] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard
from fusionguard.core.state import STATE

GB = 1e9


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make(q_len, kv_len, hq, hkv, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(h, n):
        return torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    q, k, v = mk(hq, q_len), mk(hkv, kv_len), mk(hkv, kv_len)
    mask = create_block_mask(causal, None, None, q_len, kv_len, device="cuda")
    return q, k, v, mask


def peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def step(fa, q, k, v, mask):
    fp, out = peak(lambda: fa(q, k, v, block_mask=mask, enable_gqa=True))
    grad = torch.ones_like(out)
    bp, _ = peak(lambda: out.backward(grad))
    return fp, bp, out.detach(), [t.grad.detach().clone() for t in (q, k, v)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--slide-only", action="store_true", help="only the recompile-limit slide")
    args = ap.parse_args()
    hq, hkv, d, q_len, kv_len = (32, 8, 128, 2048, 10240) if not args.small else (8, 2, 64, 256, 1024)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": getattr(__import__("triton"), "__version__", None),
        "shape": [1, hq, hkv, q_len, kv_len, d],
    }
    rows = []
    if args.slide_only:
        fusionguard.enable(strict=True, rescue=True, log_path=False)
        return slide(rows, meta, q_len, kv_len, hq, hkv, d, args)

    # 1. dense reference and plain compiled, no fusionguard
    q, k, v, mask = make(q_len, kv_len, hq, hkv, d)
    dfp, dbp, dout, dgrads = step(flex_attention, q, k, v, mask)
    rows.append(("eager dense (reference)", dfp, dbp, 0.0, 0.0, None))
    compiled = torch.compile(flex_attention)
    q, k, v, mask = make(q_len, kv_len, hq, hkv, d)
    cfp, cbp, cout, cgrads = step(compiled, q, k, v, mask)
    rows.append(("torch.compile(flex_attention)", cfp, cbp, rel(cout, dout), max(rel(a, b) for a, b in zip(cgrads, dgrads)), None))

    # 2. eager call with rescue (strict: anything dense would raise)
    torch._dynamo.reset()
    fusionguard.enable(strict=True, rescue=True, log_path=False)
    for _ in range(2):  # first step compiles
        q, k, v, mask = make(q_len, kv_len, hq, hkv, d)
        rfp, rbp, rout, rgrads = step(flex_attention, q, k, v, mask)
    rows.append(
        (
            "eager + rescue (step 2)",
            rfp,
            rbp,
            rel(rout, dout),
            max(rel(a, b) for a, b in zip(rgrads, dgrads)),
            STATE.counts.get("rescue_compiles", 0),
        )
    )

    return slide(rows, meta, q_len, kv_len, hq, hkv, d, args)


def slide(rows, meta, q_len, kv_len, hq, hkv, d, args) -> None:
    # 3. the recompile-limit slide, rescued
    torch._dynamo.reset()
    STATE.counts.clear()
    with torch._dynamo.config.patch(recompile_limit=1):

        def attention(q, k, v, mask):
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)

        attn = torch.compile(attention, dynamic=False)
        lengths = [q_len] + [q_len - 128 * random.Random(i).randint(1, 8) for i in range(19)]
        slide = []
        for i, L in enumerate(lengths):
            q, k, v, mask = make(L, kv_len, hq, hkv, d, seed=i)
            fp, out = peak(lambda: attn(q, k, v, mask))
            bp, _ = peak(lambda: out.backward(torch.ones_like(out)))
            slide.append((fp, bp))
    causes = sorted({e.get("cause") for e in fusionguard.events("flex_call") if e.get("path") == "rescued"})
    rows.append(
        (
            f"recompile-limit slide + rescue, 20 steps ({len(set(lengths))} lengths), causes {causes}",
            max(f for f, _ in slide[1:]),
            max(b for _, b in slide[1:]),
            None,
            None,
            STATE.counts.get("rescue_compiles", 0),
        )
    )
    dense = [e for e in fusionguard.events("flex_call") if e.get("path") == "dense"]
    fusionguard.disable()

    print(json.dumps(meta))
    print(f"{'mode':<64} {'fwd GB':>8} {'bwd GB':>8} {'out rel':>9} {'grad rel':>9} {'compiles':>8}")

    def fmt(x):
        return "-" if x is None else f"{x:.2e}"

    for name, fp, bp, orl, grl, n in rows:
        print(f"{name:<64} {fp / GB:>8.3f} {bp / GB:>8.3f} {fmt(orl):>9} {fmt(grl):>9} {n if n is not None else '-':>8}")
    print(f"dense executions while rescue was on: {len(dense)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows, "dense": len(dense)}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
