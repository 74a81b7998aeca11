"""Dense masks: ``create_block_mask`` / ``create_mask`` run eagerly materialise the whole
B x H x Q x KV mask (and, for a block mask, a padded copy and an int64 reduction input: about
10 bytes per element). At 128k tokens that is an out-of-memory before any attention runs.

The seam is the ``create_mask`` global of ``torch.nn.attention.flex_attention``: every
``create_block_mask`` looks it up at call time, whatever way the user imported it, so one
wrapper sees both functions. Each eager build writes a ``mask_build`` event with its estimate,
taken *before* the build allocates; above ``mask_limit`` strict mode raises and warn mode
warns at the user's line. Under ``torch.compile`` the wrapper reduces to the original call (a
trace-time note records the compiled build once per compile): nothing is added to the graph.
"""

from __future__ import annotations

import inspect
import operator
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from fusionguard.core import frames
from fusionguard.core.config import Runtime, RuntimeRef
from fusionguard.core.state import STATE, count, dense_allowed_here, guarded
from fusionguard.dense.guard import oom_cannot_act
from fusionguard.dense.memory import default_mask_limit, free_bytes, mask_build_bytes
from fusionguard.errors import DenseFallbackError
from fusionguard.eventlog.formatting import human_bytes, site_text
from fusionguard.eventlog.messages import dense_text
from fusionguard.torch_internals import MASK_COMPILE_FLAG, block_sizes, create_block_mask_code, mask_home, tracing_here
from fusionguard.watching import naming

_is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)
_is_dynamo_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", _is_compiling)

_limits: Dict[Tuple[str, Optional[int]], Optional[int]] = {}  # (device type, index) -> the default limit, read once
_fix: Optional[str] = None  # fix_text(), worked out once per process (the torch release does not change)


def _note_compiled() -> int:
    """Runs at *trace time*, once per compile of a frame that builds a mask (``torch.compile(
    create_block_mask)``, ``_compile=True``): the compiled build is recorded, the graph untouched."""
    with guarded("compiled mask note"):
        if STATE.enabled:
            count("mask_build_compiled")
            site = frames.user_call_site(sys._getframe(1))
            STATE.log.emit("info", "mask_build", path="compiled", traced=True, call_site=site)
    return 0


try:  # Dynamo calls it while tracing and bakes in the result: no op, no guard in the graph
    _NOTE: Callable[[], int] = torch.compiler.assume_constant_result(_note_compiled)
except Exception:  # pragma: no cover - very old torch
    _NOTE = _note_compiled


def fix_text() -> str:
    """The fix, naming ``_compile=True`` only where this release still accepts it (the
    signature is read once per process, not at every eager build)."""
    global _fix
    if _fix is None:
        _fix = _fix_text()
    return _fix


def _fix_text() -> str:
    compile_flag = ""
    try:
        params = inspect.signature(mask_home()["create_block_mask"]).parameters
        if MASK_COMPILE_FLAG in params:
            compile_flag = " (or `create_block_mask(..., _compile=True)`, deprecated from 2.13)"
    except Exception:
        pass
    return (
        "compile the mask creation: `create_block_mask = torch.compile(create_block_mask)`"
        + compile_flag
        + "; and build the mask once, outside the training loop, then reuse it"
    )


def _limit(rt: Runtime, device: Any) -> Optional[int]:
    limit = rt.mask_limit
    if limit is not None:
        return int(limit)
    kind = getattr(device, "type", "cpu")
    index = getattr(device, "index", None)
    if kind == "cuda" and index is None:  # (a build on CUDA initialises it anyway)
        index = torch.cuda.current_device()
    key = (kind, index)  # per device: two GPUs of one host may differ in memory
    if key not in _limits:  # read at the first build on that device, not at enable()
        _limits[key] = default_mask_limit(torch.device(kind, index) if index is not None else device)
    return _limits[key]


def _size(x: Any, default: Optional[int] = None) -> Optional[int]:
    """An integer size as PyTorch takes it: an int, a NumPy integer, a 0-d integer tensor
    (``operator.index``); ``default`` for None; None for anything else (PyTorch then says what
    is wrong) or a negative size. ``B=0`` stays 0."""
    if x is None:
        return default
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dim() != 0):  # (a 1-element tensor has __index__ too)
        return None
    try:
        n = operator.index(x)
    except (TypeError, ValueError, RuntimeError):
        return None
    return n if n >= 0 else None


def _dims(args: tuple, kwargs: dict) -> Optional[Tuple[Any, int, int, int, int, Any]]:
    """The build's arguments; None when they are not sizes (PyTorch then says what is wrong) or
    the build is on the meta device (it allocates nothing: tracing, as the flex guard has it)."""
    names = ("mod_fn", "B", "H", "Q_LEN", "KV_LEN", "device")
    values = {**dict(zip(names, args)), **kwargs}
    b, h = _size(values.get("B"), 1), _size(values.get("H"), 1)  # None: broadcast over it
    q_len, kv_len = _size(values.get("Q_LEN")), _size(values.get("KV_LEN"))
    if b is None or h is None or q_len is None or kv_len is None:
        return None
    device = values.get("device")
    if device is None:
        accelerator = getattr(torch, "accelerator", None)
        device = accelerator.current_accelerator() if accelerator is not None else None
    try:
        dev = torch.device(device or "cpu")
    except (RuntimeError, TypeError, ValueError):
        return None
    if dev.type == "meta":
        return None
    return values.get("mod_fn"), b, h, q_len, kv_len, dev


def message(event: Dict[str, Any]) -> str:
    what = "create_block_mask" if event.get("kind") == "block_mask" else "create_mask"
    size = human_bytes(event.get("estimated_bytes"), unknown="unknown size")
    limit = human_bytes(event.get("mask_limit"), unknown="none")
    head = {
        "raise": f"{what} blocked before it built a dense {size} mask eagerly (strict mode)",
        "warn": f"{what} is building a dense {size} mask eagerly",
    }.get(event.get("action") or "", f"{what} builds a dense {size} mask eagerly")
    layer = f" in {event['layer']}" if event.get("layer") else ""
    lines = [
        f"fusionguard: {head}{layer}",
        f"  at:       {site_text(event.get('call_site'), 'unknown call site')}",
        f"  shape:    B x H x Q x KV {event.get('shape')} on {event.get('device')}; estimate {size}, mask_limit {limit}"
        + (f", free {human_bytes(event.get('free_bytes'))}" if event.get("free_bytes") is not None else ""),
        f"  fix:      {event.get('fix')}",
    ]
    if event.get("action") == "raise":
        lines.append("  (to build it eagerly on purpose: `with fusionguard.allow_dense(): ...`)")
    return "\n".join(lines)


def _check(rt: Runtime, frame: Any, args: tuple, kwargs: dict) -> Tuple[Optional[Dict[str, Any]], Any]:
    """(the build's event, the user's frame); ``rt``: the settings read once for this build."""
    dims = _dims(args, kwargs)
    if dims is None:
        return None, None
    mod_fn, b, h, q_len, kv_len, device = dims
    block = frame is not None and frame.f_code is create_block_mask_code()
    user = frame.f_back if block else frame
    if block:
        sizes = block_sizes(frame)
        estimate = mask_build_bytes(b, h, q_len, kv_len, sizes, "block_mask")
    else:
        n_params = len(inspect.signature(mod_fn).parameters) if callable(mod_fn) else 4
        estimate = mask_build_bytes(b, h, q_len, kv_len, kind="mask", score_mod=n_params == 5)
    limit = _limit(rt, device)
    free = free_bytes(device)
    over = limit is not None and estimate > limit
    wont_fit = free is not None and estimate > free
    allowed = dense_allowed_here()
    if not allowed:
        oom_cannot_act(rt, free, device)
    if allowed:
        action = "allow"
    elif (over and rt.strict) or (wont_fit and rt.mode == "oom"):
        action = "raise"
    elif over or wont_fit:
        action = "warn"
    else:
        action = "log"
    site_frame = frames.first_user_frame(user)
    call_site = frames.frame_site(site_frame) if site_frame is not None else None
    fields: Dict[str, Any] = {
        "path": "dense",
        "kind": "block_mask" if block else "mask",
        "shape": [b, h, q_len, kv_len],
        "device": str(device),
        "estimated_bytes": estimate,
        "mask_limit": limit,
        "free_bytes": free,
        "action": action,
        "mode": rt.mode,
        "call_site": call_site,
        "layer": naming.flex_layer(user),
        "fix": fix_text(),
    }
    count("mask_build_dense")
    if action == "raise":
        count("mask_build_blocked")
    key = ("mask_build", (call_site or {}).get("file"), (call_site or {}).get("line"), action)
    durable = action == "raise" or key not in STATE.durable_keys
    if durable and len(STATE.durable_keys) < 10_000:
        STATE.durable_keys.add(key)
    level = "info" if action in ("log", "allow") else "warning"
    logged = STATE.log.emit(level, "mask_build", durable=durable, **fields)
    event = {**logged, **fields} if logged and logged.get("event") == "mask_build" else dict(fields)
    event["event"] = "mask_build"
    return event, site_frame


_MASK_CHECK = guarded("mask build check")


def make_create_mask_wrapper(runtime: RuntimeRef, original: Callable[..., Any]) -> Callable[..., Any]:
    """``create_mask``'s wrapper; ``runtime`` is ``STATE.runtime``, read once per build."""

    def create_mask(*args: Any, **kwargs: Any) -> Any:
        if _is_dynamo_compiling():
            _NOTE()  # a compiled build: recorded at trace time, nothing in the graph
            return original(*args, **kwargs)
        rt = runtime.now  # one read per build: on/off and the settings together
        # (is_compiling() is process-wide: another thread's compile must not hide this build)
        if not rt.enabled or (_is_compiling() and tracing_here()):
            return original(*args, **kwargs)
        blocked = warning = site = None
        with _MASK_CHECK:  # (a mask build costs milliseconds: the with's 0.1 us is nothing to it)
            event, site = _check(rt, sys._getframe(1), args, kwargs)
            if event is not None and event.get("action") in ("raise", "warn"):
                text = message(event)
                if event["action"] == "raise":
                    blocked = DenseFallbackError(text, event)
                else:
                    warning = text
                dense_text(text, 40 if blocked else 30)
        if blocked is not None:
            raise blocked
        if warning is not None:
            frames.warn_at_user_line(warning, site)
        return original(*args, **kwargs)

    create_mask.__wrapped__ = original  # type: ignore[attr-defined]
    create_mask.__name__ = getattr(original, "__name__", "create_mask")
    create_mask.__qualname__ = getattr(original, "__qualname__", "create_mask")
    create_mask.__doc__ = getattr(original, "__doc__", None)
    return create_mask
