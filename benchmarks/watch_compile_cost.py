"""What ``watch()`` adds to a warm compile when Dynamo compiles the watched model itself (#24):
fusionguard cannot know the model will run inside a graph, so its modules carry watch()'s hooks.

Patterns (a tiny FlexAttention model, ``tests/compile_models.Model`` with ``--layers`` blocks):

- ``a``: ``watch(model)``, then ``torch.compile(model)``;
- ``b``: a compiled function calling the model (``torch.compile(step)``, ``step`` calls ``model``);
- ``c``: ``watch(model)``, then ``model.compile()``.

Variants, rotated each round: ``none`` (fusionguard enabled, no watch()), ``watch`` (the hooks
out of Dynamo's sight while it compiles: the default), ``traced`` (the hooks left in its sight,
what every release before #24 compiled: ``_testing.keep_out_of_sight(False)``; on a
tree before #24, which lacks it, ``watch`` and ``traced`` both measure its own watch()).

Each trial makes a fresh model, calls ``torch._dynamo.reset()`` and times the first call: the
compile (Dynamo, AOTAutograd, Inductor) and one run. Warm: a throw-away compile of every
pattern and variant first fills Inductor's FX-graph and AOTAutograd caches (a fresh
``TORCHINDUCTOR_CACHE_DIR`` unless one is set), so each timed trial loads its graph from them,
the compile a re-run of a training script pays. ``--backward`` (CUDA) times a training step
(the backward graph compiled at its first run). Printed per pattern and variant: the median
wall and CPU (process) time, the median of the per-round ratios to ``none``, and, from the last
round, Dynamo's guards, frames compiled, graphs and graph breaks; ``--calls`` adds the Python
calls made during the compile (deterministic where times are not: a busy host).

    python benchmarks/watch_compile_cost.py [--rounds 5] [--layers 8] [--device cuda] [--backward] [--calls]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # (before torch reads it)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fg-watch-compile-")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from compile_models import Model, tokens  # noqa: E402

import fusionguard  # noqa: E402
from fusionguard.watching import hooks  # noqa: E402

PATTERNS = {
    "a": "watch(model), then torch.compile(model)",
    "b": "a compiled function calling the model",
    "c": "watch(model), then model.compile()",
}
VARIANTS = ("none", "watch", "traced")
try:
    from fusionguard._testing import keep_out_of_sight
except ImportError:  # a tree before #33 kept it in watching.hooks; before #24: none
    keep_out_of_sight = getattr(hooks, "keep_out_of_sight", lambda on: None)


def compile_step(pattern: str, model: torch.nn.Module):
    if pattern == "a":
        return torch.compile(model)
    if pattern == "b":

        def step(x):
            return model(x)

        return torch.compile(step)
    model.compile()
    return model


def trial(pattern: str, variant: str, args: argparse.Namespace):
    """(wall s, CPU s, Python calls while compiling or None, Dynamo's numbers) of one warm compile."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Model(n=args.layers, h=args.heads, d=args.head_dim).to(args.device)
    x = tokens(device=args.device, l=args.seq, h=args.heads, d=args.head_dim, requires_grad=args.backward)
    keep_out_of_sight(variant != "traced")
    calls = [0]

    def count(frame, event, arg):
        calls[0] += 1

    def started(*_):
        sys.setprofile(count)

    def ended(*_):
        sys.setprofile(None)

    if args.calls:  # (after reset(), which clears Dynamo's compile callbacks)
        torch._dynamo.callback.callback_handler.register_start_callback(started)
        torch._dynamo.callback.callback_handler.register_end_callback(ended)
    torch._dynamo.utils.clear_compilation_metrics()  # (a capped deque: counted from empty)
    w = fusionguard.watch(model).__enter__() if variant != "none" else None
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    gc.collect()  # (the last trial's garbage is not this one's cost)
    with torch.enable_grad() if args.backward else torch.no_grad():
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        step = compile_step(pattern, model)
        out = step(x)
        if args.backward:
            out.sum().backward()
        sync()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for _ in range(2):  # (no recompile on later steps)
            out = step(x)
            if args.backward:
                out.sum().backward()
    if w is not None:
        w.__exit__(None, None, None)
    keep_out_of_sight(True)
    frames = list(torch._dynamo.utils.get_compilation_metrics())
    stats = torch._dynamo.utils.counters
    dynamo = {
        "guards": sum(m.guard_count or 0 for m in frames),
        "frames": len(frames),
        "graphs": stats["stats"].get("unique_graphs", 0),
        "breaks": sum(stats["graph_break"].values()),
    }
    return wall, cpu, calls[0] if args.calls else None, dynamo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--patterns", default="abc")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backward", action="store_true", help="a training step (CUDA: FlexAttention has no CPU backward)")
    ap.add_argument("--calls", action="store_true", help="count Python calls while Dynamo compiles (slows the compile)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.seq, args.heads, args.head_dim = (1024, 8, 64) if cuda else (32, 2, 8)
    if args.backward and not cuda:
        ap.error("--backward needs a CUDA device (FlexAttention has no backward on CPU)")
    warnings.simplefilter("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fusionguard.enable(log_path=False)
    order = [(p, v) for p in args.patterns for v in VARIANTS]
    for p, v in order:  # throw-away compiles: Inductor's caches warm
        trial(p, v, args)
    runs = {k: [] for k in order}
    last = {}
    for r in range(args.rounds):
        for p, v in order[r % len(order) :] + order[: r % len(order)]:
            wall, cpu, calls, dynamo = trial(p, v, args)
            runs[(p, v)].append((wall, cpu, calls))
            last[(p, v)] = dynamo
            print(f"round {r} ({p}) {v}: {wall:.2f} s wall, {cpu:.2f} s CPU", file=sys.stderr, flush=True)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"torch {torch.__version__}, {name}, {args.layers} blocks, {'training step' if args.backward else 'inference'}, "
        f"{args.rounds} rounds, TORCHINDUCTOR_CACHE_DIR={os.environ['TORCHINDUCTOR_CACHE_DIR']}"
    )
    print(
        f"{'pattern':<44} {'variant':<7} {'wall s':>7} {'/ none':>7} {'CPU s':>7} {'/ none':>7} {'calls /none':>11}  "
        "guards frames graphs breaks"
    )
    for p in args.patterns:
        base = runs[(p, "none")]
        for v in VARIANTS:
            rs = runs[(p, v)]
            ratio = [statistics.median(a[i] / b[i] for a, b in zip(rs, base)) for i in (0, 1)]
            calls = f"{statistics.median(a[2] / b[2] for a, b in zip(rs, base)):11.3f}" if args.calls else f"{'':>11}"
            d = last[(p, v)]
            print(
                f"({p}) {PATTERNS[p]:<40} {v:<7} {statistics.median(x[0] for x in rs):7.2f} {ratio[0]:7.3f} "
                f"{statistics.median(x[1] for x in rs):7.2f} {ratio[1]:7.3f} {calls}  "
                f"{d['guards']:6} {d['frames']:6} {d['graphs']:6} {d['breaks']:6}"
            )


if __name__ == "__main__":
    main()
