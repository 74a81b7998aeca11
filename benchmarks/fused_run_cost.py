"""fusionguard's work per compiled-graph run on the fused path, in microseconds: one tiny
compiled FlexAttention graph (Inductor, fused), called with fusionguard's enabled flag set and
cleared on alternate calls (order alternating within pairs); median of the per-pair differences.
The graph is compiled with fusionguard on, so it carries the per-run counting that is timed.

    python benchmarks/fused_run_cost.py [--device cpu|cuda] [--pairs 3000]
"""

from __future__ import annotations

import argparse

import torch
from paired import paired
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.core.state import STATE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pairs", type=int, default=3000)
    args = ap.parse_args()
    fusionguard.enable(log_path=False)
    q = torch.randn(1, 2, 32, 16, device=args.device)
    k, v = torch.randn_like(q), torch.randn_like(q)
    fn = torch.compile(flex_attention)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        for _ in range(20):
            fn(q, k, v)
        before = STATE.counts.get("fused_runs_forward", 0)
        diff, plain = paired(lambda: fn(q, k, v), args.pairs, sync)
    counted = STATE.counts.get("fused_runs_forward", 0) - before
    fusionguard.disable()
    assert counted == args.pairs, f"fusionguard counted {counted} fused runs, expected {args.pairs}"
    print(
        f"{args.device}, torch {torch.__version__}: graph run {plain * 1e6:.1f} us unguarded; "
        f"fusionguard per run {diff * 1e6:+.2f} us (median of {args.pairs} pairs; {counted} runs counted)"
    )


if __name__ == "__main__":
    main()
