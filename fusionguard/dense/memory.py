"""How much memory the dense paths need, worked out before they run, and how much the device
can still give.

Why its own module: these are pure accounting functions over shapes and dtypes (the guard and
the mask hook call them before the kernel runs); the numbers come from walking PyTorch's eager
code (``math_attention``, ``sdpa_dense_backward``, ``create_mask``, ``_convert_mask_to_block_mask``;
the same code 2.7 to 2.15) and were checked against measured peaks (docs/measurements.md).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from fusionguard.torch_internals import IDENTITY_SCORE_MOD

#: What ``enable(mask_limit=None)`` resolves to: this fraction of the building device's memory.
MASK_LIMIT_FRACTION = 0.10


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    import torch  # lazy: torch loads on first use, never when this module is imported

    return torch.empty((), dtype=dtype).element_size()


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def mask_build_bytes(
    b: int, h: int, q_len: int, kv_len: int, block: Sequence[int] = (128, 128), kind: str = "block_mask", score_mod: bool = False
) -> int:
    """Extra peak bytes of an eager ``create_block_mask`` / ``create_mask``.

    ``create_mask``: the bool B x H x Q x KV mask (1 byte per element); from a ``score_mod``, a
    float32 score tensor, its result and the ``isneginf`` mask (9 bytes). ``create_block_mask`` adds
    ``_convert_mask_to_block_mask``: a padded copy of the mask (1 byte per element of the mask
    padded to whole blocks) and the int64 that ``sum`` over the blocks reads (8 bytes per padded
    element): about 10 bytes per element (measured 9.2 to 10.7 on CPU).
    """
    elements = b * h * q_len * kv_len
    if kind == "mask":
        return elements * (9 if score_mod else 1)
    padded = b * h * _round_up(q_len, block[0]) * _round_up(kv_len, block[1])
    return elements + 9 * padded


def _is_identity(fn: Any) -> bool:
    """True for the no-op score_mod: ``_identity``, or the traced graph of it (no computation)."""
    if getattr(fn, "__name__", None) == IDENTITY_SCORE_MOD:
        return True
    graph = getattr(fn, "graph", None)
    nodes = getattr(graph, "nodes", None)
    if nodes is None:
        return False
    return not any(n.op in ("call_function", "call_method", "call_module") for n in nodes)


def _captured_bytes(buffers: Any, q_len: int, kv_len: int) -> int:
    """Bytes per score element added by captured tensors indexed by query *and* key position
    (e.g. a ``[H, Q, KV]`` bias): vmap gathers them to the full score shape, and broadcasts an
    int64 index grid per indexed dimension to that shape too (measured on the H200: a float32
    ``bias[h, q, kv]`` made the forward 32 B per score element, where 4 + 3 x 8 + 4 predicts 32).
    Smaller ones (a per-token document id) are gathered per dimension and broadcast: no
    score-sized copy."""
    total = 0
    for t in buffers or ():
        numel = getattr(t, "numel", None)
        if callable(numel) and numel() >= q_len * kv_len:
            total += _itemsize(t.dtype) + 8 * int(getattr(t, "dim", lambda: 2)())
    return total


def predict_dense(
    phase: str, q: Any, k: Any, v: Any, score_mod: Any = None, score_buffers: Any = (), mask_buffers: Any = ()
) -> Optional[int]:
    """Predicted extra peak bytes of ``sdpa_dense`` (forward) / ``sdpa_dense_backward`` on CUDA.

    S = B*Hq*Q*KV score elements; w = 4 (8 for float64) working precision bytes, d = input bytes.
    Forward: the largest of the masking step (scores, bool mask, a score_mod result unless it
    is the identity, then the larger of a captured score-sized tensor's gather and the ``where``
    result) and ``_safe_softmax`` (input, softmax, ``eq`` mask, ``where``: 3w+1), times S, plus K
    and V repeated to Hq heads (``repeat_interleave`` copies even for 1 group). Backward:
    scores, masked scores, softmax, grad of softmax, grad of score_mod and its scaled copy (6w)
    plus its cast to d, and w more for a score_mod that is not the identity, times S, plus the
    repeated K and V, the gradient buffers and the Hq-head grad of V.
    The dense path ignores block sparsity. ``None`` when the shapes are not plain 4-d.
    """
    try:
        bq, hq, q_len, dqk = (int(s) for s in q.shape)
        _, hkv, kv_len, _ = (int(s) for s in k.shape)
        dv = int(v.shape[-1])
    except Exception:
        return None
    import torch  # lazy: torch loads on first use, never when this module is imported

    w = 8 if q.dtype == torch.float64 else 4
    d = _itemsize(q.dtype)
    s = bq * hq * q_len * kv_len
    extra_mod = 0 if score_mod is None or _is_identity(score_mod) else w
    captured = _captured_bytes(score_buffers, q_len, kv_len) + _captured_bytes(mask_buffers, q_len, kv_len)
    repeats = bq * hq * kv_len * (dqk + dv) * d
    lse = bq * hq * q_len * 4
    if phase == "forward":
        # masking: scores, mask, a score_mod's result, then a captured tensor's gather (inside
        # score_mod) or the ``where`` result, whichever is larger; vs ``_safe_softmax``
        per = max(w + max(captured, 1 + extra_mod + w), 3 * w + 1)
        return s * per + repeats + lse
    # (a captured tensor's gather is freed before the peak: measured 28 B/elt with a bias, 30
    # with ``s * 2``, 26 with none, bf16; CPU, the same elementwise allocations as CUDA)
    # a captured score-sized tensor: eager autograd re-gathers it with its index grids (H200,
    # float32 ``bias[h, q, kv]``: 48 B per element eager, 32 under aot_eager: the safe side kept)
    per = 6 * w + d + extra_mod + captured - (4 if captured else 0)
    grads = bq * hq * q_len * dqk * d + bq * hkv * kv_len * (dqk + dv) * d + bq * hq * kv_len * dv * d
    return s * per + repeats + grads + 2 * lse


def free_bytes(device: Any) -> Optional[int]:
    """What this process's CUDA caching allocator can still give on ``device``: about
    min(driver free + reserved-but-free, fraction x total - allocated), the fraction being the
    per-process cap (``set_per_process_memory_fraction``, ``PYTORCH_CUDA_ALLOC_CONF``; shared GPUs,
    notebooks): the allocator refuses past it whatever the driver has free. ``None`` off CUDA: no
    allocator to ask (CPU memory is shared with the rest of the machine; the oom mode acts on
    CUDA only). One driver call (``torch.cuda.mem_get_info``, about 0.8 ms on the H200): callers
    ask only where they need it."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_initialized():
        return None
    if getattr(device, "index", 0) is None:  # ("cuda": the current device; the fraction getter needs an index)
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    allocated = int(torch.cuda.memory_allocated(device))
    give = int(free) + max(0, int(torch.cuda.memory_reserved(device)) - allocated)
    fraction = memory_fraction(device)
    if fraction is not None and fraction < 1:
        give = min(give, max(0, int(fraction * int(total)) - allocated))
    return give


def memory_fraction(device: Any) -> Optional[float]:
    """This process's cap on ``device`` as a fraction of its memory: PyTorch's own answer
    (``torch.cuda.get_per_process_memory_fraction``) where this release has it, else the
    ``per_process_memory_fraction`` of ``PYTORCH_CUDA_ALLOC_CONF``; None when neither says."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get is not None:
        try:
            return float(get(device))
        except Exception:
            pass
    return alloc_conf_fraction(os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"))


def alloc_conf_fraction(conf: Optional[str]) -> Optional[float]:
    """``per_process_memory_fraction`` of an allocator setting (``"expandable_segments:True,
    per_process_memory_fraction:0.5"``), or None (absent, malformed, outside 0..1)."""
    for part in (conf or "").split(","):
        key, _, value = part.partition(":")
        if key.strip() == "per_process_memory_fraction":
            try:
                fraction = float(value)
            except ValueError:
                return None
            return fraction if 0 <= fraction <= 1 else None
    return None


def device_memory(device: Any) -> Optional[int]:
    """Total memory of the device a mask is built on: the CUDA device's (read when the first
    mask is built there, never at ``enable()``: that would initialise CUDA), else physical RAM."""
    kind = getattr(device, "type", None) or str(device or "cpu").split(":")[0]
    try:
        if kind == "cuda":
            import torch  # lazy: torch loads on first use, never when this module is imported

            index = getattr(device, "index", None)
            return int(torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).total_memory)
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def default_mask_limit(device: Any) -> Optional[int]:
    """``MASK_LIMIT_FRACTION`` of the device's memory (``None`` when it cannot be read)."""
    total = device_memory(device)
    return None if total is None else int(total * MASK_LIMIT_FRACTION)
