"""``fusionguard doctor``: the reference experiment (the shape of the first reports of this
failure: bf16, 32/8 heads, Q=2048, KV=10240, head_dim 128) on your own machine.

Eager vs ``torch.compile(flex_attention)``, without and with a causal BlockMask, with GQA,
forward and backward (GPU; CPU checks inference only, as PyTorch trains FlexAttention only on
accelerators). For each case: what fusionguard logged, forward and backward peak memory above
the start, and a last line ``FUSED - OK`` or a clear failure with its cause. Exit status 0 only
when the compiled path is fused in every direction checked; 1 when something ran dense or an
experiment failed; bad options are refused before anything runs (``check_options``, exit 2).
A progress line per experiment goes to stderr as it starts (compiles take seconds on a CPU).
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import fusionguard

REFERENCE_SHAPE = (1, 32, 8, 2048, 10240, 128)  # B, Hq, Hkv, Q, KV, head_dim (the first reports' shape)
CPU_SHAPE = (1, 4, 2, 256, 256, 16)


def _versions() -> Dict[str, Any]:
    import torch  # lazy: torch loads on first use, never when this module is imported

    info: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton  # type: ignore  # lazy: optional, and it imports torch

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            cuda=torch.version.cuda,
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gb=round(props.total_memory / 1e9, 1),
        )
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
            )
            info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except Exception:
            info["driver"] = None
    else:
        info["device"] = "cpu"
    return info


def default_shape() -> Tuple[int, ...]:
    """The reference shape when the GPU has room for its dense run (~18 GB), else scaled down."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    if not torch.cuda.is_available():
        return CPU_SHAPE
    free, _ = torch.cuda.mem_get_info()
    b, hq, hkv, q, kv, d = REFERENCE_SHAPE
    while b * hq * q * kv * 4 * 2.5 > free and q > 128:  # dense backward needs ~2x the fp32 scores
        q, kv = q // 2, kv // 2
    return (b, hq, hkv, q, kv, d)


def check_options(device: Optional[str], backend: str) -> Optional[str]:
    """What is wrong with ``--device`` / ``--backend`` (None: nothing), found before any run."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            return f"--device {device!r} is not a device torch knows ({str(exc).splitlines()[0]}); use cpu, cuda or cuda:N"
        if dev.type not in ("cpu", "cuda"):
            return f"--device {device!r}: doctor runs on cpu or cuda"
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                return f"--device {device!r}: no CUDA device is available here (torch {torch.__version__})"
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                return f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    known: Optional[List[str]] = None
    usual: List[str] = []
    try:
        known, usual = torch.compiler.list_backends(exclude_tags=()), torch.compiler.list_backends()
    except Exception:  # pragma: no cover - an older torch: let torch.compile decide
        pass
    if known is not None and backend not in known:
        return f"--backend {backend!r} is not a torch.compile backend here; e.g. {', '.join(sorted(usual or known))}"
    return None


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def _peak(fn: Any, cuda: bool) -> Tuple[Optional[int], Any, Optional[BaseException]]:
    import torch  # lazy: torch loads on first use, never when this module is imported

    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:
        error = exc
    if not cuda:
        return None, result, error
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, result, error


def run_case(name: str, compiled: bool, masked: bool, shape: Sequence[int], device: str, backend: str = "inductor") -> Dict[str, Any]:
    import torch  # lazy: torch loads on first use, never when this module is imported
    from torch.nn.attention.flex_attention import (
        create_block_mask,
        flex_attention,
    )  # lazy: torch loads on first use, never when this module is imported

    b, hq, hkv, q_len, kv_len, d = shape
    cuda = device.startswith("cuda")
    train = cuda
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def mk(h: int, n: int) -> torch.Tensor:
        return torch.randn(b, h, n, d, device=device, dtype=dtype, generator=g).requires_grad_(train)

    q, k, v = mk(hq, q_len), mk(hkv, kv_len), mk(hkv, kv_len)
    mask = create_block_mask(_causal, None, None, q_len, kv_len, device=device) if masked else None
    if compiled:
        torch.compiler.reset()  # a fresh compile (or cache load), so the fused record is made now
    fn = torch.compile(flex_attention, backend=backend) if compiled else flex_attention
    before = len(fusionguard.events())
    fwd_peak, out, fwd_err = _peak(lambda: fn(q, k, v, block_mask=mask, enable_gqa=True), cuda)
    bwd_peak, bwd_err = None, None
    if train and out is not None:
        grad = torch.ones_like(out)
        bwd_peak, _, bwd_err = _peak(lambda: out.backward(grad), cuda)
    events = [e for e in fusionguard.events()[before:] if e.get("event") in ("flex_call", "flex_compile")]
    paths: Dict[str, set] = {}
    for e in events:
        paths.setdefault(e["phase"], set()).add((e["path"], e.get("cause") or e.get("template")))
    return {
        "case": name,
        "compiled": compiled,
        "phases": ["forward", "backward"] if train else ["forward"],
        "paths": {p: sorted(v) for p, v in paths.items()},
        "fwd_peak": fwd_peak,
        "bwd_peak": bwd_peak,
        "error": f"{type(fwd_err or bwd_err).__name__}: {fwd_err or bwd_err}" if (fwd_err or bwd_err) else None,
    }


def _gb(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def main(
    shape: Optional[Sequence[int]] = None,
    device: Optional[str] = None,
    out: Any = None,
    backend: str = "inductor",
    progress: Any = sys.stderr,
) -> int:
    """Run the experiment, print the table and the verdict; 0 only if compiled is fused both ways,
    1 otherwise (dense, or an experiment failed). ``progress``: a line per experiment as it starts."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    out = out or sys.stdout
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = tuple(shape) if shape else default_shape()
    info = _versions()
    out.write("fusionguard doctor\n")
    out.write("  " + ", ".join(f"{k} {v}" for k, v in info.items() if v is not None) + "\n")
    out.write(f"  shape B={shape[0]} Hq={shape[1]} Hkv={shape[2]} Q={shape[3]} KV={shape[4]} D={shape[5]} on {device}")
    out.write("" if device.startswith("cuda") else " (CPU: inference only; PyTorch trains FlexAttention on accelerators)")
    if backend != "inductor":
        out.write(f"\n  compiled with backend={backend!r}")
    out.write("\n\n")
    was_enabled = fusionguard.is_enabled()
    fusionguard.enable(strict=False, log_path=False)
    rows: List[Dict[str, Any]] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cases = [(masked, compiled) for masked in (False, True) for compiled in (False, True)]
            for i, (masked, compiled) in enumerate(cases, 1):
                name = f"{'compiled' if compiled else 'eager':<8} {'causal BlockMask' if masked else 'no mask':<16} GQA"
                if progress is not None:
                    progress.write(
                        f"fusionguard doctor: [{i}/{len(cases)}] {' '.join(name.split())}{' (compiling)' if compiled else ''} ...\n"
                    )
                    progress.flush()
                t0 = time.perf_counter()
                try:
                    row = run_case(name, compiled, masked, shape, device, backend)
                except Exception as exc:  # the experiment itself failed: a finding, exit 1
                    row = {
                        "case": name,
                        "compiled": compiled,
                        "phases": ["forward"],
                        "paths": {},
                        "fwd_peak": None,
                        "bwd_peak": None,
                        "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                    }
                row["seconds"] = time.perf_counter() - t0
                rows.append(row)
                verdict = "; ".join(
                    f"{p}: " + ", ".join(f"{a} ({b})" for a, b in row["paths"].get(p, [])) or f"{p}: nothing logged" for p in row["phases"]
                )
                out.write(f"  {name:<34} fwd {_gb(row['fwd_peak']):>9}  bwd {_gb(row['bwd_peak']):>9}  {verdict}\n")
                out.flush()
                if row["error"]:
                    out.write(f"      error: {row['error']}\n")
    finally:
        if not was_enabled:
            fusionguard.disable()
    failures = []
    for row in rows:
        if not row["compiled"]:
            if row["error"]:  # the eager reference itself failed to run
                failures.append(f"{row['case'].strip()}: {row['error']}")
            continue
        for phase in row["phases"]:
            got = row["paths"].get(phase, [])
            if row["error"]:
                failures.append(f"{row['case'].strip()}: {row['error']}")
            elif any(p == "dense" for p, _ in got):
                causes = ", ".join(c for p, c in got if p == "dense")
                failures.append(f"{row['case'].strip()} {phase} ran DENSE (cause: {causes})")
            elif not any(p == "fused" for p, _ in got):
                failures.append(f"{row['case'].strip()} {phase}: no fused kernel recorded")
    out.write("\n")
    if failures:
        for f in failures:
            out.write(f"  FAIL: {f}\n")
        out.write("DENSE - the compiled path is not fused here (see above)\n")
        return 1
    out.write("FUSED - OK\n")
    return 0
