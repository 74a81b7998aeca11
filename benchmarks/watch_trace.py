"""What ``watch()`` adds to a compile: Dynamo's trace time of an 8-block model (attention-like
and MLP submodules, 24 user modules), ``backend="eager"`` so that only Dynamo's own work is
timed (Inductor's share of a real compile is unchanged by hooks), fresh ``torch._dynamo.reset()``
each trace; every variant once per round in rotated order, medians and ranges of the
per-round ratios.

    python benchmarks/watch_trace.py [--rounds 8]

Variants: no watch; ``watch(model)`` with ``model`` the module inside ``torch.compile``;
``watch(compiled)``; ``watch(model)`` with the wrapper made before ``enable()`` (fusionguard
cannot know it: Dynamo traced the hooks before #24; out of its sight while it compiles since,
``watch_compile_cost.py``). Also prints Dynamo's graph counters (no extra graphs or recompiles).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

import fusionguard


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return x + self.o(torch.relu(self.q(x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)

    def forward(self, x):
        return x + self.a(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp, self.norm = Attn(), MLP(), nn.LayerNorm(64)

    def forward(self, x):
        return self.mlp(self.attn(self.norm(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


VARIANTS = ("none", "watch(model)", "watch(compiled)", "watch(model), wrapper before enable()")


def trace_once(variant: str):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = Model()
    if variant.endswith("before enable()"):  # a wrapper fusionguard does not know (hooks out of Dynamo's sight)
        fusionguard.disable()
        compiled = torch.compile(model, backend="eager")
        fusionguard.enable(log_path=False)
    else:
        compiled = torch.compile(model, backend="eager")
    x = torch.randn(2, 64)
    w = None if variant == "none" else fusionguard.watch(compiled if variant == "watch(compiled)" else model)
    if w is not None:
        w.__enter__()
    t = time.perf_counter()
    compiled(x)
    elapsed = time.perf_counter() - t
    compiled(x)
    compiled(x)
    if w is not None:
        w.__exit__(None, None, None)
    return elapsed, dict(torch._dynamo.utils.counters["stats"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    fusionguard.enable(log_path=False)
    trace_once("none")  # imports, first-time Dynamo set-up
    times = {v: [] for v in VARIANTS}
    ratios = {v: [] for v in VARIANTS}
    stats = {}
    for r in range(args.rounds):  # every variant once per round, in rotated order
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        got = {}
        for v in order:
            got[v], stats[v] = trace_once(v)
            times[v].append(got[v])
        for v in VARIANTS:
            ratios[v].append(got[v] / got["none"])
    for v in VARIANTS:
        rs = ratios[v]
        print(
            f"{v:<38} trace {statistics.median(times[v]) * 1e3:7.1f} ms  x{statistics.median(rs):.3f} "
            f"({min(rs):.3f}-{max(rs):.3f})  {stats[v]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
