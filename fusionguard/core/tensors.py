"""What a dense or fused FlexAttention call's tensors say: shapes, dtype, device and the size of
the score matrix the dense path would materialise. Shared by the dense guard, rescue and the
Inductor records, so both paths describe a call the same way."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from fusionguard.core.state import STATE


def _shape(t: Any) -> Optional[list]:
    try:
        return [int(s) for s in t.shape]
    except Exception:
        return None  # nested / jagged layouts have no plain shape


def scores_bytes(q_shape: Optional[list], kv_shape: Optional[list]) -> Optional[int]:
    """Bytes of the fp32 B x Hq x Q x KV score matrix the dense path materialises."""
    if not q_shape or not kv_shape or len(q_shape) < 4 or len(kv_shape) < 2:
        return None
    b, hq, q_len = q_shape[0], q_shape[1], q_shape[-2]
    return int(b) * int(hq) * int(q_len) * int(kv_shape[-2]) * 4


# The last few shapes' fields and the last dense call's message per phase: a training loop
# repeats the same dense call, and these strings are rebuilt on the dense path otherwise
# (STATE.caches: tensor_fields, messages).


def tensor_fields(q: Any, k: Any) -> Dict[str, Any]:
    key = None
    cache = STATE.caches.tensor_fields
    if type(q) is torch.Tensor and type(k) is torch.Tensor:
        key = (q.shape, k.shape, q.dtype, q.device)
        known = cache.get(key)
        if known is not None:
            return known
    fields = _make_tensor_fields(q, k)
    if key is not None:
        if len(cache) >= 64:
            cache.clear()
        cache[key] = fields
    return fields


def _make_tensor_fields(q: Any, k: Any) -> Dict[str, Any]:
    q_shape, kv_shape = _shape(q), _shape(k)
    fields: Dict[str, Any] = {
        "q_shape": q_shape,
        "kv_shape": kv_shape,
        "dtype": str(getattr(q, "dtype", None)).replace("torch.", ""),
        "device": str(getattr(q, "device", None)),
        "scores_bytes": scores_bytes(q_shape, kv_shape),
    }
    if getattr(q, "is_nested", False):
        fields["layout"] = "nested"
    return fields
