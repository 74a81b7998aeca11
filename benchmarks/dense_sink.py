"""The dense guard's cost per repeated dense call: paired calls (guard off / on, alternating
order), a small dense call so the guard's fixed work shows. Two modes: the default (after the
first 10 of one call site, repeats are counted, not written) and ``keep_all=True`` (every call
written), each for a log file in --dir, one in /dev/shm (memory) and no file (log_path=False).
``--max-bytes N``: the files rotate at N bytes (``log_max_bytes``), the locked write of a log
that several processes may share.

    python benchmarks/dense_sink.py [--device cuda] [--pairs 300] [--dir /tmp] [--max-bytes 65536]
    python benchmarks/dense_sink.py --profile [--calls 300]   # where the guard's time goes (cProfile)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import warnings

import torch
from paired import paired
from torch.nn.attention.flex_attention import flex_attention

import fusionguard


def small_inputs(device: str):
    """A small GQA dense call (fp32, 8/2 heads, 128 x 128): short, so the guard's fixed work shows."""
    q = torch.randn(1, 8, 128, 64, device=device)
    k = torch.randn(1, 2, 128, 64, device=device)
    return q, k, torch.randn_like(k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--profile", action="store_true", help="cProfile --calls guarded calls instead")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--max-bytes", type=int, default=None, help="log_max_bytes: rotating files")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    q, k, v = small_inputs(args.device)
    if args.profile:
        profile(q, k, v, args.calls, os.path.join(args.dir, "fg-dense-profile.jsonl"))
        return
    sinks = {
        "file in " + args.dir: os.path.join(args.dir, "fg-dense-sink.jsonl"),
        "file in /dev/shm": "/dev/shm/fg-dense-sink.jsonl",
        "no file": False,
    }
    for keep_all in (False, True):
        for label, path in sinks.items():
            if path and not os.path.isdir(os.path.dirname(path)):
                continue
            rotating = ", rotating" if args.max_bytes and path else ""
            measure(
                f"{'keep_all' if keep_all else 'sampled'}, {label}{rotating}", q, k, v, path, keep_all, args.pairs, sync, args.max_bytes
            )


def measure(label, q, k, v, path, keep_all, pairs, sync, max_bytes=None) -> None:
    fusionguard.enable(log_path=path, keep_all=keep_all, log_max_bytes=max_bytes if path else None)
    for _ in range(10):
        flex_attention(q, k, v, enable_gqa=True)
    diff, plain = paired(lambda: flex_attention(q, k, v, enable_gqa=True), pairs, sync)
    fusionguard.disable()
    print(f"{label:<42} plain {plain * 1e3:.3f} ms, guard {diff * 1e6:+.0f} us", flush=True)


def profile(q, k, v, calls: int, log: str) -> None:
    """cProfile over ``calls`` guarded dense calls: the guard's own functions by time."""
    fusionguard.enable(log_path=log)
    for _ in range(20):
        flex_attention(q, k, v, enable_gqa=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        flex_attention(q, k, v, enable_gqa=True)
    prof.disable()
    fusionguard.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(r"fusionguard|structlog|json|warnings|inspect|linecache|traceback|cuda", 25)


if __name__ == "__main__":
    main()
