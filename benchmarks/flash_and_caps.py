"""#35 on a CUDA GPU: the FLASH backend's verdicts and costs, the dense FLASH LSE, and the oom
mode's ``free_bytes`` under a per-process cap.

1. ``flash``: compiled training steps (B=1, H=16, S=4096, D=128, bf16, causal) with
   ``kernel_options={"BACKEND": "FLASH"}`` and with the default Triton kernels: fusionguard's
   verdict and template, median step time (fusionguard off / strict), peak memory against one
   fp32 score matrix. Skipped when ``flash_attn.cute`` is not importable.
2. ``lse``: a dense (eager) FLASH call's LSE over the fused Triton kernel's (natural log), and
   ``lse_scale`` from the event.
3. ``caps``: ``free_bytes`` with ``set_per_process_memory_fraction`` capping the process at
   6 GB, against the driver's free memory and the capacity measured by allocating 256 MB chunks
   until the allocator refuses; and the cost of one ``free_bytes`` call.

    python benchmarks/flash_and_caps.py --md benchmarks/RESULTS-flash-caps.md   # appends a section

Each part runs in its own process (the cap stays with a process).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


def _mask(L: int) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: q >= kv, None, None, L, L, device="cuda")


def flash() -> Dict[str, Any]:
    from torch.nn.attention.flex_attention import flex_attention

    import fusionguard
    from fusionguard import _testing
    from fusionguard.core import state as _state

    if importlib.util.find_spec("flash_attn.cute") is None:
        return {"skipped": "flash_attn.cute is not importable"}
    B, H, L, D, steps = 1, 16, 4096, 128, 10
    mask = _mask(L)
    out: Dict[str, Any] = {"shape": [B, H, L, D], "scores_fp32_gb": B * H * L * L * 4 / GB}
    for backend in ("FLASH", "TRITON"):
        fn = torch.compile(flex_attention)
        options = {"BACKEND": backend}
        row: Dict[str, Any] = {}
        for guarded in (False, True, False, True):  # alternating: drift cancels
            if guarded:
                fusionguard.enable(strict=True, log_path=False)
            times = []
            for _ in range(steps):
                q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t = time.perf_counter()
                fn(q, k, v, block_mask=mask, kernel_options=options).float().square().sum().backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
                row["peak_gb"] = (torch.cuda.max_memory_allocated() - base) / GB
            key = "strict" if guarded else "off"
            row.setdefault(f"step_ms_{key}", []).append(1e3 * statistics.median(times[2:]))
            if guarded:
                compiles = [e for e in fusionguard.events() if e["event"] == "flex_compile"]
                row["templates"] = sorted({(c["phase"], c["template"]) for c in compiles})
                row["dense_calls"] = sum(1 for e in fusionguard.events() if e["event"] == "flex_call")
                row["fused_runs"] = [_state.STATE.counts.get("fused_runs_forward"), _state.STATE.counts.get("fused_runs_backward")]
                fusionguard.disable()
                _testing.reset_for_tests()
        for key in ("step_ms_off", "step_ms_strict"):
            row[key] = round(statistics.median(row[key]), 3)
        out[backend] = row
    return out


def lse() -> Dict[str, Any]:
    from torch.nn.attention.flex_attention import flex_attention

    import fusionguard

    L = 1024
    mask = _mask(L)
    q, k, v = (torch.randn(1, 4, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = torch.compile(flex_attention)(q, k, v, block_mask=mask, return_lse=True)[1].float()
    fusionguard.enable(log_path=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = flex_attention(q, k, v, block_mask=mask, return_lse=True, kernel_options={"BACKEND": "FLASH"})[1].float()
    events = [e for e in fusionguard.events() if e["event"] == "flex_call"]
    fusionguard.disable()
    return {
        "dense_flash_over_fused": round((got / ref).mean().item(), 4),
        "lse_scale": events[0].get("lse_scale") if events else None,
        "warned": any("LSE" in str(w.message) for w in seen),
    }


def caps() -> Dict[str, Any]:
    from fusionguard.dense.memory import free_bytes

    dev = torch.device("cuda")
    torch.cuda.init()
    total = torch.cuda.mem_get_info()[1]
    cap = 6 * (1 << 30)
    torch.cuda.set_per_process_memory_fraction(cap / total)
    driver_free = torch.cuda.mem_get_info()[0]
    said = free_bytes(dev)
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        free_bytes(dev)
    cost_us = 1e6 * (time.perf_counter() - t) / n
    chunks: List[Any] = []
    try:
        while True:
            chunks.append(torch.empty(256 << 20, dtype=torch.uint8, device=dev))
    except torch.OutOfMemoryError:
        pass
    got = len(chunks) * (256 << 20)
    return {
        "cap_gb": cap / GB,
        "driver_free_gb": round(driver_free / GB, 3),
        "free_bytes_gb": round(said / GB, 3) if said is not None else None,
        "allocated_until_refused_gb": round(got / GB, 3),
        "free_bytes_us_per_call": round(cost_us, 1),
    }


PARTS = {"flash": flash, "lse": lse, "caps": caps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=sorted(PARTS))
    ap.add_argument("--md", help="append the results as a Markdown section to this file")
    args = ap.parse_args()
    if args.part:  # one part, in this process
        warnings.simplefilter("ignore")
        print(json.dumps(PARTS[args.part]()))
        return
    results: Dict[str, Any] = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for part in PARTS:
        proc = subprocess.run([sys.executable, __file__, "--part", part], env=env, capture_output=True, text=True, timeout=900)
        lines = proc.stdout.strip().splitlines()
        results[part] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.stderr[-1500:]}
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    head = (
        f"## {datetime.date.today()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton_version}, "
        f"Python {platform.python_version()}"
    )
    try:
        from importlib.metadata import version

        head += f", flash-attn-4 {version('flash-attn-4')}, nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}"
    except Exception:
        pass
    text = head + "\n\n```json\n" + json.dumps(results, indent=1) + "\n```\n"
    print(text)
    if args.md:
        with open(args.md, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
