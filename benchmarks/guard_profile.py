"""Where the guard's own time goes on a dense call: cProfile over many small eager dense calls.

    python benchmarks/guard_profile.py [--device cuda] [--calls 300]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
import warnings

import torch
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from dense_sink import small_inputs  # benchmarks/ is on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--log", default="/tmp/fusionguard-profile.jsonl")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    q, k, v = small_inputs(args.device)

    def calls(n: int) -> float:
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            flex_attention(q, k, v, enable_gqa=True)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6

    calls(20)
    plain = calls(args.calls)
    fusionguard.enable(log_path=args.log)
    calls(20)
    guarded = calls(args.calls)
    prof = cProfile.Profile()
    prof.enable()
    calls(args.calls)
    prof.disable()
    fusionguard.disable()
    print(f"median per call: plain {plain:.0f} us, guarded {guarded:.0f} us, guard {guarded - plain:+.0f} us")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(r"fusionguard|structlog|json|warnings|inspect|linecache|traceback|cuda", 25)


if __name__ == "__main__":
    main()
