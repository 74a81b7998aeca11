"""What fusionguard costs: an 8-layer FlexAttention block stack, compiled with Inductor, training.

Side by side in one process: no fusionguard / fusionguard enabled / enabled + watch(model) /
torch.profiler(profile_memory=True) (the tool users reach for to answer the same question).
For each: compile time, median step time over --steps steps after warm-up, graphs / graph
breaks / recompiles, and the ratio to the unguarded run. Then the same variants step by step on
one compiled model (``interleaved``: host drift cancels). Then the eager dense path: the dense
call with and without the guard, and the guard's own work per dense call as a share of it, with
a sync after every call (the guard's host time fully exposed) and with calls queued back to back
as a training loop runs them.

    python benchmarks/overhead.py                 # GPU, seed-like shapes
    python benchmarks/overhead.py --device cpu --small --steps 5 --rounds 1  # smoke run (inference)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import time
import warnings

import torch
from paired import paired
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Block(nn.Module):
    def __init__(self, dim, hq, hkv, d):
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, d
        self.norm = nn.RMSNorm(dim)
        self.q = nn.Linear(dim, hq * d, bias=False)
        self.kv = nn.Linear(dim, 2 * hkv * d, bias=False)
        self.o = nn.Linear(hq * d, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.GELU(), nn.Linear(2 * dim, dim, bias=False))

    def forward(self, x, mask):
        b, n, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, n, self.hq, self.d).transpose(1, 2).contiguous()  # (Inductor CPU template needs a 4-D buffer)
        k, v = self.kv(h).view(b, n, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4).contiguous()
        a = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, n, self.hq * self.d))
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self, layers, dim, hq, hkv, d):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, hq, hkv, d) for _ in range(layers))

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def counts():
    c = torch._dynamo.utils.counters
    return {"graphs": c["stats"].get("unique_graphs", 0), "breaks": sum(c["graph_break"].values()), "frames": c["frames"].get("total", 0)}


def _dtype(args):
    return torch.bfloat16 if args.device.startswith("cuda") else torch.float32


def make_step(args, shape, model, holder):
    """One training step (GPU) or inference call (CPU) of ``holder["compiled"]``."""
    n, dim = shape[0], shape[1]
    train = args.device.startswith("cuda")
    x = torch.randn(1, n, dim, device=args.device, dtype=_dtype(args), requires_grad=train)
    mask = create_block_mask(causal, None, None, n, n, device=args.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6) if train else None

    def step():
        if train:
            holder["compiled"](x, mask).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                holder["compiled"](x, mask)

    return step


def run_variant(name, args, shape, ctx_factory):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Stack(args.layers, *shape[1:]).to(args.device, _dtype(args))
    late = getattr(ctx_factory, "wrapper_before_enable", False)
    holder = {"compiled": torch.compile(model) if late else None}
    step = make_step(args, shape, model, holder)

    with ctx_factory(model, lambda: holder["compiled"] if late else torch.compile(model)) as ctx:
        holder["compiled"] = ctx.pop("compiled")
        t0 = time.perf_counter()
        step()
        sync(args.device)
        compile_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            sync(args.device)
            t = time.perf_counter()
            step()
            sync(args.device)
            times.append(time.perf_counter() - t)
            if "prof" in ctx:
                ctx["prof"].step()
    return {"variant": name, "compile_s": compile_s, "median_ms": statistics.median(times) * 1e3, **counts()}


# Each variant gets the model and a function that makes its torch.compile wrapper (called
# after fusionguard.enable(), as in a script that enables at the top), and yields a dict with
# the wrapper under "compiled" (a profiler variant adds "prof").


@contextlib.contextmanager
def none(model, make):
    yield {"compiled": make()}


@contextlib.contextmanager
def guarded(model, make, watch_inner=False, watch_compiled=False):
    fusionguard.enable(strict=True, log_path=False)
    try:
        compiled = make()
        target = model if watch_inner else compiled if watch_compiled else None
        with fusionguard.watch(target) if target is not None else contextlib.nullcontext():
            yield {"compiled": compiled}
    finally:
        fusionguard.disable()


def enabled(model, make):
    return guarded(model, make)


def watched(model, make):
    """watch(model) beside compiled = torch.compile(model): fusionguard knows the wrapper."""
    return guarded(model, make, watch_inner=True)


def watched_compiled(model, make):
    """watch() given the compiled module (``model = torch.compile(model)``)."""
    return guarded(model, make, watch_compiled=True)


def watched_late(model, make):
    """watch(model), with the torch.compile wrapper made before enable(): fusionguard cannot
    know it, so Dynamo traces the hooks inside (the case the watch_traced warning is about)."""
    return guarded(model, make, watch_inner=True)


watched_late.wrapper_before_enable = True


def memory_profiler():
    """``torch.profiler`` with ``profile_memory=True``: the tool users reach for instead."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=acts, profile_memory=True, record_shapes=False)


@contextlib.contextmanager
def profiled(model, make):
    compiled = make()
    with memory_profiler() as prof:
        yield {"compiled": compiled, "prof": prof}


def interleaved(args, shape):
    """Step time, variant against variant within each step: one model compiled once with
    fusionguard enabled, then every timed step runs each variant once in rotated order, so host
    drift between rounds (+-10-25 % on the device hosts) cancels. The graph is compiled with
    fusionguard on, so it carries fusionguard's per-graph-run counting (checked: the counted
    runs grow in every fusionguard variant). Variants: ``off`` (fusionguard's enabled flag
    cleared: the counting wrapper returns at once, the closest to none a shared compiled graph
    allows; the rounds above measure a true none), ``enabled``, ``watch(compiled)`` and
    ``watch(model)`` entered around each step (outside the timed region, as around a loop), and
    ``torch.profiler(profile_memory=True)`` with fusionguard off. Median of the per-step ratios
    to ``off``."""
    from fusionguard._testing import set_guarding
    from fusionguard.core.state import STATE

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Stack(args.layers, *shape[1:]).to(args.device, _dtype(args))
    fusionguard.enable(strict=True, log_path=False)  # at the top of a script: before torch.compile
    compiled = torch.compile(model)
    train = args.device.startswith("cuda")
    step = make_step(args, shape, model, {"compiled": compiled})

    ctxs = {
        "off": contextlib.nullcontext,
        "enabled": contextlib.nullcontext,
        "watch(compiled)": lambda: fusionguard.watch(compiled),
        "watch(model)": lambda: fusionguard.watch(model),
        "profiler": memory_profiler,
    }
    names = list(ctxs)
    on = {"enabled", "watch(compiled)", "watch(model)"}  # the profiler runs without fusionguard
    runs_key = "fused_runs_backward" if train else "fused_runs_forward"
    try:
        # compile with fusionguard on (its per-graph-run counting is installed at compile time),
        # then warm every variant
        for name in ["enabled"] + names * 2 + names[:1] * args.warmup:
            set_guarding(name in on)
            with ctxs[name]():
                step()
        times = {name: [] for name in names}
        runs = {name: 0 for name in names}  # fused graph runs fusionguard counted, per variant
        for i in range(args.steps * 2):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                set_guarding(name in on)
                before = STATE.counts.get(runs_key, 0)
                with ctxs[name]():
                    sync(args.device)
                    t = time.perf_counter()
                    step()
                    sync(args.device)
                    times[name].append(time.perf_counter() - t)
                runs[name] += STATE.counts.get(runs_key, 0) - before
        set_guarding(True)
        graphs = counts()
    finally:
        set_guarding(True)
        fusionguard.disable()
    if not all(runs[name] for name in on):  # the variants must time fusionguard's fused-path work
        raise SystemExit(f"interleaved: fusionguard counted no fused runs in some variants: {runs}")
    out = {"graphs": graphs, "steps": len(times["off"]), "counted_runs": runs, "rows": []}
    for name in names:
        ratios = [a / b for a, b in zip(times[name], times["off"])]
        q = statistics.quantiles(ratios, n=4)
        out["rows"].append(
            {
                "variant": name,
                "median_ms": statistics.median(times[name]) * 1e3,
                "step_ratio": statistics.median(ratios),
                "step_ratio_iqr": (q[0], q[2]),
            }
        )
    return out


def dense_cost(args, shape):
    """The eager dense call with and without the guard, in alternating blocks (drift cancels):
    at the seed-like shape (the ratio users see) and at a tiny shape, where the kernel is short
    and the guard's fixed per-call work (stack walk, event, JSON line, fsync) shows clearly."""
    n, dim, hq, hkv, d = shape
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    warnings.simplefilter("ignore")
    out = {}
    for label, q_len, kv_len in (("seed", n, n * args.kv_factor), ("tiny", 128, 128)):
        q = torch.randn(1, hq, q_len, d, device=args.device, dtype=dtype)
        k = torch.randn(1, hkv, kv_len, d, device=args.device, dtype=dtype)
        v = torch.randn_like(k)
        reps = args.dense_reps if label == "seed" else 10 * args.dense_reps
        times = {"plain": [], "fsync_default": [], "fsync_always": []}
        for _ in range(args.rounds):
            for variant in times:
                if variant != "plain":
                    fusionguard.enable(log_path=args.log, fsync=True if variant == "fsync_default" else "always")
                flex_attention(q, k, v, enable_gqa=True)  # untimed: the first event of a site is fsync-ed
                for _ in range(reps):
                    sync(args.device)
                    t = time.perf_counter()
                    flex_attention(q, k, v, enable_gqa=True)
                    sync(args.device)
                    times[variant].append(time.perf_counter() - t)
                if variant != "plain":
                    fusionguard.disable()
        plain = statistics.median(times["plain"])
        out[label] = {"plain_ms": plain * 1e3}
        for variant in ("fsync_default", "fsync_always"):
            guarded = statistics.median(times[variant])
            out[label][f"{variant}_ms"] = guarded * 1e3
            out[label][f"{variant}_ratio"] = guarded / plain
            out[label][f"{variant}_cost_us"] = (guarded - plain) * 1e6
        # Paired, call by call (benchmarks/paired.py): drift between blocks cancels.
        fusionguard.enable(log_path=args.log)
        flex_attention(q, k, v, enable_gqa=True)
        diff, plain_call = paired(lambda: flex_attention(q, k, v, enable_gqa=True), args.rounds * reps, lambda: sync(args.device))
        out[label]["paired_cost_us"] = diff * 1e6
        out[label]["paired_share"] = diff / plain_call
        # Back to back, one sync per block (a training loop does not sync per call: the host
        # queues work while the GPU runs, so the guard's host time can hide behind the kernels).
        diff, plain_call = paired(lambda: flex_attention(q, k, v, enable_gqa=True), args.rounds * 4, lambda: sync(args.device), per=5)
        out[label]["pipelined"] = {"cost_us": diff * 1e6, "plain_ms": plain_call * 1e3, "share": diff / plain_call}
        fusionguard.disable()
    # the guard's fixed cost (measured at the tiny shape) as a share of the seed-shape dense call
    for variant in ("fsync_default", "fsync_always"):
        out[f"{variant}_fixed_share"] = out["tiny"][f"{variant}_cost_us"] / (out["seed"]["plain_ms"] * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5, help="each variant runs once per round, in rotated order")
    ap.add_argument("--dense-reps", type=int, default=10, help="timed dense calls per variant and round")
    ap.add_argument("--kv-factor", type=int, default=5, help="KV = factor x Q in the dense check (seed: 10240/2048)")
    ap.add_argument("--log", default="/tmp/fusionguard-overhead.jsonl")
    ap.add_argument("--json")
    ap.add_argument("--skip-steps", action="store_true", help="only the dense-path measurement")
    ap.add_argument("--skip-dense", action="store_true", help="no dense-path measurement")
    args = ap.parse_args()
    shape = (2048, 2048, 32, 8, 128) if not args.small else (128, 64, 4, 2, 16)  # N, dim, Hq, Hkv, D
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "layers": args.layers,
        "shape(N,dim,Hq,Hkv,D)": shape,
        "steps": args.steps,
        "rounds": args.rounds,
        "train": args.device.startswith("cuda"),
    }
    print(json.dumps(meta), flush=True)
    variants = (
        ("none", none),
        ("enabled", enabled),
        ("watched", watched),
        ("watched_c", watched_compiled),
        ("watch_late", watched_late),
        ("profiler", profiled),
    )
    summary = []
    if not args.skip_steps:
        run_variant("warm-up", args, shape, none)  # fills Inductor's caches: every variant then compiles warm
        per_round = []
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            rows = {name: run_variant(name, args, shape, f) for name, f in order}
            per_round.append(rows)
            print(f"round {r}: " + ", ".join(f"{k} {v['median_ms']:.3f} ms / {v['compile_s']:.2f} s" for k, v in rows.items()), flush=True)
        for name, _ in variants:
            step_ratios = [rows[name]["median_ms"] / rows["none"]["median_ms"] for rows in per_round]
            compile_ratios = [rows[name]["compile_s"] / rows["none"]["compile_s"] for rows in per_round]
            last = per_round[-1][name]
            summary.append(
                {
                    "variant": name,
                    "compile_s": statistics.median(rows[name]["compile_s"] for rows in per_round),
                    "compile_ratio": statistics.median(compile_ratios),
                    "compile_ratio_range": (min(compile_ratios), max(compile_ratios)),
                    "median_ms": statistics.median(rows[name]["median_ms"] for rows in per_round),
                    "step_ratio": statistics.median(step_ratios),
                    "step_ratio_range": (min(step_ratios), max(step_ratios)),
                    "graphs": last["graphs"],
                    "breaks": last["breaks"],
                    "frames": last["frames"],
                }
            )
        print(
            f"{'variant':<10} {'compile s':>9} {'x (min-max)':>20} {'step ms':>9} {'x (min-max)':>20} "
            f"{'graphs':>6} {'breaks':>6} {'frames':>6}"
        )
        for r in summary:
            cr, sr = r["compile_ratio_range"], r["step_ratio_range"]
            print(
                f"{r['variant']:<10} {r['compile_s']:>9.2f} {r['compile_ratio']:>6.3f} ({cr[0]:.3f}-{cr[1]:.3f}) "
                f"{r['median_ms']:>9.3f} {r['step_ratio']:>6.3f} ({sr[0]:.3f}-{sr[1]:.3f}) "
                f"{r['graphs']:>6} {r['breaks']:>6} {r['frames']:>6}"
            )
    inter = None
    if not args.skip_steps:
        inter = interleaved(args, shape)
        print(
            f"interleaved, step by step ({inter['steps']} steps per variant; Dynamo: {inter['graphs']}; "
            f"fused runs counted: {inter['counted_runs']}):"
        )
        print(f"{'variant':<16} {'step ms':>9} {'x off':>7} {'(IQR of per-step ratios)':>26}")
        for r in inter["rows"]:
            lo, hi = r["step_ratio_iqr"]
            print(f"{r['variant']:<16} {r['median_ms']:>9.3f} {r['step_ratio']:>7.4f}  ({lo:.4f}-{hi:.4f})")
    dense = None if args.skip_dense else dense_cost(args, shape)
    if dense is not None:
        for label in ("seed", "tiny"):
            d = dense[label]
            print(
                f"dense call ({label}) {d['plain_ms']:.3f} ms plain; guarded {d['fsync_default_ms']:.3f} ms "
                f"(x{d['fsync_default_ratio']:.4f}, {d['fsync_default_cost_us']:+.0f} us, fsync=True) / "
                f"{d['fsync_always_ms']:.3f} ms (x{d['fsync_always_ratio']:.4f}, {d['fsync_always_cost_us']:+.0f} us, fsync='always')"
            )
        for label in ("seed", "tiny"):
            d = dense[label]
            print(f"paired, call by call ({label}): guard {d['paired_cost_us']:+.0f} us = {d['paired_share'] * 100:.2f} % of the call")
            p = d["pipelined"]
            print(
                f"pipelined, 5 calls per sync ({label}): guard {p['cost_us']:+.0f} us per call = "
                f"{p['share'] * 100:.2f} % of {p['plain_ms']:.3f} ms"
            )
        print(
            f"guard's fixed cost per dense call as a share of the seed-shape call: "
            f"{dense['fsync_default_fixed_share'] * 100:.2f} % (fsync=True), "
            f"{dense['fsync_always_fixed_share'] * 100:.2f} % (fsync='always')"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": summary, "interleaved": inter, "dense": dense}, fh, indent=1)


def _triton_version():
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


if __name__ == "__main__":
    main()
