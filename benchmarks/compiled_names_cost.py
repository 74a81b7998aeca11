"""What naming compiled graphs per layer costs (issue 17), on CPU or CUDA:

- per graph run under watch(): a 2-block model with each block compiled in place
  (``block.compile()``: one graph, named by the block running it) and the same model compiled
  whole (one graph of both layers' calls), fusionguard's enabled flag on/off on alternate steps
  (benchmarks/paired.py); per step and per graph run; per-block again without watch() (issue
  28: named from the model holding the block), and the one lookup that finds that model;
- the search ``enable()`` makes for graphs compiled before it: N small graphs compiled first
  (the same code in N functions: Inductor's cache answers after the first), then the search.

    python benchmarks/compiled_names_cost.py [--device cpu|cuda] [--pairs 1000] [--graphs 300]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from compile_models import Model, tokens  # noqa: E402
from paired import paired  # noqa: E402

import fusionguard  # noqa: E402
from fusionguard.core.state import STATE  # noqa: E402
from fusionguard.fused import inductor  # noqa: E402


def search_cost(n: int) -> None:
    fns = []
    for i in range(n):
        scope: dict = {}
        exec(f"def f{i}(x):\n    return x * 2 + 1\n", scope)  # a code object of its own: a graph each
        fns.append(torch.compile(scope[f"f{i}"]))
    x = torch.randn(8)
    t0 = time.perf_counter()
    for fn in fns:
        fn(x)
    compile_s = time.perf_counter() - t0
    from fusionguard import torch_internals as ti

    graphs = len(ti.found_compiled_graphs())
    best = min(inductor.live_flex_graphs()[1] for _ in range(5))
    print(
        f"search: {graphs} compiled graphs alive, {len(gc.get_objects()):,} gc objects: "
        f"live_flex_graphs() {best:.1f} ms (best of 5); compiling them took {compile_s:.1f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--graphs", type=int, default=300)
    args = ap.parse_args()
    fusionguard.enable(log_path=False)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    x = tokens(device=args.device)
    for pattern in ("per_block", "whole", "per_block_unwatched"):
        model = Model().to(args.device)
        if pattern.startswith("per_block"):
            for block in model.layers:
                block.compile()
            step = model
        else:
            step = torch.compile(model)
        with fusionguard.watch(model) if pattern != "per_block_unwatched" else contextlib.nullcontext(), torch.no_grad():
            for _ in range(5):
                step(x)
            before = STATE.counts.get("fused_runs_forward", 0)
            diff, plain = paired(lambda: step(x), args.pairs, sync)
        runs = (STATE.counts.get("fused_runs_forward", 0) - before) // args.pairs
        print(
            f"{pattern}: {args.device}, torch {torch.__version__}: step {plain * 1e6:.1f} us unguarded; fusionguard "
            f"{diff * 1e6:+.2f} us per step, {runs} graph run(s) per step (median of {args.pairs} pairs)"
        )
    fusionguard.disable()
    paths_cost()
    search_cost(args.graphs)


def paths_cost() -> None:
    """The lookup that names a module without watch(): one pass over the live objects."""
    from fusionguard.watching import paths

    best = float("inf")
    for _ in range(5):
        STATE.caches.module_paths.clear()
        STATE.caches.module_paths.noted = True  # (the partial-names note once, not per round)
        model = Model()
        t0 = time.perf_counter()
        assert str(paths.module_path(model.layers[1].attn)).endswith("layers.1.attn")
        best = min(best, time.perf_counter() - t0)
    print(f"names without watch(): {len(gc.get_objects()):,} gc objects: first module_path() {best * 1e3:.1f} ms (best of 5)")


if __name__ == "__main__":
    main()
