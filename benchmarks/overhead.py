"""What fusionguard costs: an 8-layer FlexAttention block stack, compiled with Inductor, training.

Side by side in one process: no fusionguard / fusionguard enabled / enabled + watch(model) /
torch.profiler(profile_memory=True) (the tool users reach for to answer the same question).
For each: compile time, median step time over --steps steps after warm-up, graphs / graph
breaks / recompiles, and the ratio to the unguarded run. Then the eager dense path: the dense
call with and without the guard, and the guard's own work per dense call as a share of it.

    python benchmarks/overhead.py                 # GPU, seed-like shapes
    python benchmarks/overhead.py --device cpu --small --steps 5   # smoke run (inference)
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


def run_variant(name, args, shape, ctx_factory):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    n, dim, hq, hkv, d = shape
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = Stack(args.layers, dim, hq, hkv, d).to(args.device, dtype)
    compiled = torch.compile(model)
    train = args.device.startswith("cuda")
    x = torch.randn(1, n, dim, device=args.device, dtype=dtype, requires_grad=train)
    mask = create_block_mask(causal, None, None, n, n, device=args.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6) if train else None

    def step():
        if train:
            compiled(x, mask).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                compiled(x, mask)

    with ctx_factory(model) as ctx:
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
            if ctx is not None and hasattr(ctx, "step"):
                ctx.step()
    return {"variant": name, "compile_s": compile_s, "median_ms": statistics.median(times) * 1e3, **counts()}


@contextlib.contextmanager
def none(model):
    yield None


@contextlib.contextmanager
def enabled(model):
    fusionguard.enable(strict=True, log_path=False)
    try:
        yield None
    finally:
        fusionguard.disable()


@contextlib.contextmanager
def watched(model):
    fusionguard.enable(strict=True, log_path=False)
    try:
        with fusionguard.watch(model):
            yield None
    finally:
        fusionguard.disable()


@contextlib.contextmanager
def profiled(model):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, profile_memory=True, record_shapes=False) as prof:
        yield prof


def dense_cost(args, shape):
    """The eager dense call with and without the guard; the guard's own work per call."""
    n, dim, hq, hkv, d = shape
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    q = torch.randn(1, hq, n, d, device=args.device, dtype=dtype)
    k = torch.randn(1, hkv, n * args.kv_factor, d, device=args.device, dtype=dtype)
    v = torch.randn_like(k)

    def med(reps=args.dense_reps):
        ts = []
        for _ in range(reps):
            sync(args.device)
            t = time.perf_counter()
            flex_attention(q, k, v, enable_gqa=True)
            sync(args.device)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    warnings.simplefilter("ignore")
    med(3)
    plain = med()
    out = {"dense_ms": plain * 1e3}
    for fsync in (True, False):
        fusionguard.enable(log_path=args.log, fsync=fsync)
        med(2)
        guarded = med()
        fusionguard.disable()
        out[f"guarded_ms_fsync_{fsync}"] = guarded * 1e3
        out[f"ratio_fsync_{fsync}"] = guarded / plain
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dense-reps", type=int, default=20)
    ap.add_argument("--kv-factor", type=int, default=5, help="KV = factor x Q in the dense check (seed: 10240/2048)")
    ap.add_argument("--log", default="/tmp/fusionguard-overhead.jsonl")
    ap.add_argument("--json")
    args = ap.parse_args()
    shape = (2048, 2048, 32, 8, 128) if not args.small else (128, 64, 4, 2, 16)  # N, dim, Hq, Hkv, D
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "layers": args.layers,
        "shape(N,dim,Hq,Hkv,D)": shape,
        "steps": args.steps,
        "train": args.device.startswith("cuda"),
    }
    run_variant("warm-up", args, shape, none)  # fills Inductor's caches: every variant then compiles warm
    rows = [run_variant(name, args, shape, f) for name, f in (("none", none), ("enabled", enabled), ("watched", watched), ("profiler", profiled))]
    base = rows[0]
    for r in rows:
        r["step_ratio"] = r["median_ms"] / base["median_ms"]
        r["compile_ratio"] = r["compile_s"] / base["compile_s"]
    dense = dense_cost(args, shape)
    print(json.dumps(meta))
    print(f"{'variant':<10} {'compile s':>9} {'x':>6} {'step ms':>9} {'x':>6} {'graphs':>6} {'breaks':>6} {'frames':>6}")
    for r in rows:
        print(
            f"{r['variant']:<10} {r['compile_s']:>9.2f} {r['compile_ratio']:>6.3f} {r['median_ms']:>9.3f} "
            f"{r['step_ratio']:>6.3f} {r['graphs']:>6} {r['breaks']:>6} {r['frames']:>6}"
        )
    print(
        f"eager dense call {dense['dense_ms']:.3f} ms; guarded {dense['guarded_ms_fsync_True']:.3f} ms "
        f"(x{dense['ratio_fsync_True']:.4f}, fsync on) / {dense['guarded_ms_fsync_False']:.3f} ms "
        f"(x{dense['ratio_fsync_False']:.4f}, fsync off)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows, "dense": dense}, fh, indent=1)


if __name__ == "__main__":
    main()
