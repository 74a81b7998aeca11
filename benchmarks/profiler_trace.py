"""fusionguard's ranges in a real CUDA profiler trace of the seed shape (#26), dense and fused.

bf16, B=1, 32 q-heads / 8 kv-heads, Q=2048, KV=10240, head_dim 128, causal BlockMask,
enable_gqa=True; a two-layer model under ``fusionguard.watch`` (so the ranges name
``layers.0`` / ``layers.1``), forward and backward, traced with ``torch.profiler`` (CPU + CUDA):

- dense: the model run eagerly (fusionguard in warn mode): one ``fusionguard: dense ...`` range
  per layer and phase, around the dense kernels (the score matrix's matmul / softmax);
- fused: the same model under ``torch.compile`` (Inductor): one ``fusionguard: fused ...``
  range per compiled-graph run, naming the layers it served, around the fused Triton kernels.

Each trace is exported (``export_chrome_trace``) and parsed back: per range name, how many, their
CPU duration, the GPU time of the kernels launched inside them (by the launch's correlation id)
and the kernels' names. The summary is printed and written as markdown:

    python benchmarks/profiler_trace.py --out benchmarks/RESULTS-profiler.md [--traces DIR] [--small]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import warnings
from typing import Any, Dict, List

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile

import fusionguard

PREFIX = "fusionguard: "


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Attn(nn.Module):
    def __init__(self, mask: Any) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        return flex_attention(q, k, v, block_mask=self.mask, enable_gqa=True)


class Model(nn.Module):
    def __init__(self, mask: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attn(mask), Attn(mask)])

    def forward(self, q, k, v):
        for layer in self.layers:
            q = layer(q, k, v)
        return q


def inputs(shape):
    b, hq, hkv, q_len, kv_len, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)

    def mk(h, n):
        return torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)

    return mk(hq, q_len), mk(hkv, kv_len), mk(hkv, kv_len)


def step(model, q, k, v):
    out = model(q, k, v)
    out.float().sum().backward()


def trace(model, shape, path: str, steps: int) -> List[Dict[str, Any]]:
    q, k, v = inputs(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(model, q, k, v)  # warm-up (and the compile) outside the profiler
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step(model, q, k, v)
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarise(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per fusionguard range name: count, CPU durations, GPU kernel time launched inside, kernels."""
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # the CPU-side ranges (a CUDA trace mirrors each as a ``gpu_user_annotation`` on the stream)
    ranges = [e for e in xs if str(e.get("name", "")).startswith(PREFIX) and e.get("cat") != "gpu_user_annotation"]
    kernels_by_corr: Dict[Any, List[Dict[str, Any]]] = {}
    for e in xs:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels_by_corr.setdefault((e.get("args") or {}).get("correlation"), []).append(e)
    launches = [e for e in xs if e.get("cat") in ("cuda_runtime", "cuda_driver") and (e.get("args") or {}).get("correlation") is not None]
    out: Dict[str, Dict[str, Any]] = {}
    for r in ranges:
        lo, hi = r["ts"], r["ts"] + r["dur"]
        inside = [e for e in launches if e.get("tid") == r.get("tid") and e.get("pid") == r.get("pid") and lo <= e["ts"] <= hi]
        kernels = [k for e in inside for k in kernels_by_corr.get(e["args"]["correlation"], [])]
        row = out.setdefault(r["name"], {"name": r["name"], "count": 0, "cpu_us": [], "gpu_us": [], "kernels": {}})
        row["count"] += 1
        row["cpu_us"].append(r["dur"])
        row["gpu_us"].append(sum(k["dur"] for k in kernels))
        for k in kernels:
            kn = str(k["name"])
            kn = kn if len(kn) < 90 else kn[:87] + "..."
            row["kernels"][kn] = row["kernels"].get(kn, 0) + 1
    return list(out.values())


def markdown(title: str, rows: List[Dict[str, Any]], steps: int) -> List[str]:
    lines = [f"### {title}", "", f"{steps} profiled steps (forward + backward each).", ""]
    if not rows:
        return lines + ["No fusionguard range in the trace.", ""]
    lines += [
        "| range | count | CPU ms (median) | GPU kernel ms inside (median) | kernels inside (launches per range) |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        per = max(1, r["count"])
        top = sorted(r["kernels"].items(), key=lambda kv: -kv[1])[:6]
        ks = "<br>".join(f"`{name.replace('|', '/')}` ×{n / per:g}" for name, n in top) or "-"
        lines.append(
            f"| `{r['name']}` | {r['count']} | {statistics.median(r['cpu_us']) / 1e3:.3f} | "
            f"{statistics.median(r['gpu_us']) / 1e3:.3f} | {ks} |"
        )
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/RESULTS-profiler.md", help="markdown summary (default %(default)s)")
    ap.add_argument("--traces", help="keep the chrome traces in this directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a quick shape for smoke runs")
    args = ap.parse_args()
    shape = (1, 32, 8, 2048, 10240, 128) if not args.small else (1, 8, 2, 256, 1024, 64)
    tdir = args.traces or tempfile.mkdtemp(prefix="fusionguard-trace-")
    os.makedirs(tdir, exist_ok=True)
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=shape[3], KV_LEN=shape[4], device="cuda")
    fusionguard.enable(strict=False, log_path=False)
    results = {}
    try:
        model = Model(mask).cuda()
        with fusionguard.watch(model, memory=False):
            results["dense (eager, warn mode)"] = summarise(trace(model, shape, os.path.join(tdir, "dense.json"), args.steps))
        model = Model(mask).cuda()
        compiled = torch.compile(model)
        with fusionguard.watch(model, memory=False):
            results["fused (torch.compile, Inductor)"] = summarise(trace(compiled, shape, os.path.join(tdir, "fused.json"), args.steps))
    finally:
        fusionguard.disable()
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": getattr(__import__("triton"), "__version__", None),
        "python": platform.python_version(),
        "fusionguard": fusionguard.__version__,
        "shape(B,Hq,Hkv,Q,KV,D)": shape,
        "dtype": "bfloat16",
    }
    lines = [
        "# fusionguard ranges in a CUDA profiler trace (seed shape)",
        "",
        "Written by `python benchmarks/profiler_trace.py --out " + args.out + "`; " + json.dumps(meta),
        "",
        "GPU kernel ms: the summed duration of the kernels launched from inside the range (matched by",
        "the launch's correlation id), per range, median over ranges of that name.",
        "",
    ]
    for title, rows in results.items():
        lines += markdown(title, rows, args.steps)
    lines.append(f"Chrome traces: `{tdir}` (open in https://ui.perfetto.dev or chrome://tracing).")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
