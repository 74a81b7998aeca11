"""Per-layer CUDA memory: the caching allocator's counters around each attention layer, peaks
folded into the enclosing layers and into the true process peak; the per-layer rows."""

from __future__ import annotations

import contextvars
import itertools
import warnings
from typing import Any, List, Optional, Tuple, Union

import torch

from fusionguard.core.state import STATE

OPEN: contextvars.ContextVar[Tuple["Measure", ...]] = contextvars.ContextVar("fusionguard_open_measures", default=())


_ORDER = itertools.count()


class Measure:
    __slots__ = ("device", "alloc", "peak", "order")

    def __init__(self, device: int, alloc: int) -> None:
        self.device, self.alloc, self.peak = device, alloc, alloc
        self.order = next(_ORDER)


def cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _fold(device: int, peak: int, opened_before: Optional[int] = None) -> None:
    """Raise the peaks of the open measures by ``peak``. When a measure stops, only those opened
    before it enclose it: backward spans of consecutive layers overlap by a hook's width, and a
    later-opened one must not inherit its predecessor's peak."""
    for m in OPEN.get():
        if m.device == device and peak > m.peak and (opened_before is None or m.order < opened_before):
            m.peak = peak
    if peak > STATE.stats.peak.get(device, 0):
        STATE.stats.peak[device] = peak


def cuda_device(obj: Any) -> Optional[int]:
    """The CUDA device of the first tensor in obj (or of a module's first parameter)."""
    if isinstance(obj, torch.nn.Module):
        for p in obj.parameters(recurse=True):
            return p.device.index if p.device.type == "cuda" else None
        return None
    for t in tensors(obj):
        return (t.device.index if t.device.index is not None else torch.cuda.current_device()) if t.is_cuda else None
    return None


def measure_start(where: Any = None) -> Optional[Measure]:
    """Start measuring on the CUDA device of ``where`` (tensors or a module); None on CPU."""
    if not cuda_ready():
        return None
    if isinstance(where, int):
        device: Optional[int] = where
    else:
        device = cuda_device(where) if where is not None else torch.cuda.current_device()
    if device is None:
        return None
    _fold(device, torch.cuda.max_memory_allocated(device))
    if not STATE.stats.warned_reset:
        STATE.stats.warned_reset = True
        warnings.warn(
            "fusionguard.watch resets torch.cuda peak memory stats around each attention layer to "
            "measure per-layer peaks: torch.cuda.max_memory_allocated() now reports the peak since "
            "the last watched layer; use fusionguard.peak_memory_allocated() for the run's peak, or "
            "watch(model, memory=False)",
            RuntimeWarning,
            stacklevel=4,
        )
    torch.cuda.reset_peak_memory_stats(device)
    m = Measure(device, torch.cuda.memory_allocated(device))
    OPEN.set(OPEN.get() + (m,))
    return m


def measure_stop(m: Optional[Measure]) -> Tuple[Optional[int], Optional[int]]:
    if m is None:
        return None, None
    stack = OPEN.get()
    if stack and stack[-1] is m:
        OPEN.set(stack[:-1])
    else:
        OPEN.set(tuple(x for x in stack if x is not m))
    peak = torch.cuda.max_memory_allocated(m.device)
    if peak > m.peak:
        m.peak = peak
    _fold(m.device, m.peak, opened_before=m.order)
    return torch.cuda.memory_allocated(m.device) - m.alloc, m.peak - m.alloc


def peak_memory_allocated(device: Union[int, torch.device, None] = None) -> int:
    """The true peak of allocated CUDA memory, also across the resets ``watch`` makes."""
    if not torch.cuda.is_available():
        return 0
    idx = torch.cuda.current_device() if device is None else torch.device("cuda", device).index if isinstance(device, int) else device.index
    idx = idx if idx is not None else torch.cuda.current_device()
    return max(STATE.stats.peak.get(idx, 0), torch.cuda.max_memory_allocated(idx))


def record(layer: str, phase: str, alloc: Optional[int], peak: Optional[int], recompute: bool = False, dense_before: int = -1) -> None:
    with STATE.stats.lock:
        row = STATE.stats.row(layer, phase)
        # dense if a dense kernel of this layer and phase ran during the span
        path = "dense" if dense_before >= 0 and row.dense + row.dense_recompute > dense_before else "fused"
        if recompute:
            row.recompute += 1
        else:
            row.calls += 1
        if alloc is not None and peak is not None:
            row.measured += 1
            row.alloc_delta_last, row.peak_delta_last = alloc, peak
            row.alloc_delta_max = alloc if row.alloc_delta_max is None else max(row.alloc_delta_max, alloc)
            row.peak_delta_max = peak if row.peak_delta_max is None else max(row.peak_delta_max, peak)
    if alloc is not None:
        STATE.log.emit("info", "layer_memory", layer=layer, phase=phase, path=path, alloc_delta=alloc, peak_delta=peak, recompute=recompute)


# -- hooks ---------------------------------------------------------------------------------------


def tensors(obj: Any) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            out.extend(tensors(x))
    elif isinstance(obj, dict):
        for x in obj.values():
            out.extend(tensors(x))
    elif hasattr(obj, "to_tuple") and callable(obj.to_tuple):  # Hugging Face ModelOutput
        out.extend(tensors(obj.to_tuple()))
    return out


def dense_count(layer: str, phase: str) -> int:
    row = STATE.stats.rows.get((layer, phase))
    return 0 if row is None else row.dense + row.dense_recompute
