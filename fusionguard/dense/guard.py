"""The run-time guard: wrappers around FlexAttention's dense kernels and its autograd Function.

Every wrapper follows one rule: our bookkeeping runs inside ``try``; the user's call runs outside
it, with its own arguments, exceptions and return values untouched. The only exception we raise
on purpose is ``DenseFallbackError`` (strict mode), and we raise it *before* calling the dense
kernel, so nothing of the score matrix has been allocated yet.

The wrappers are plain functions. When Dynamo happens to trace one (it inlines a higher-order
operator's Python implementation in a few fallback cases), ``torch.compiler.is_dynamo_compiling()``
is a constant ``True`` for it and the wrapper reduces to the original call: no graph break, no guard.

Whether a call is a real execution is decided by its tensors (``is_concrete``), per call, never by
``torch.compiler.is_compiling()``: that is one process-wide flag, which Dynamo holds ``True`` for the
whole of a compile (torch 2.13+; export sets it too), whatever thread compiles. A guard that stepped
aside on it let every dense call of the *other* threads run unseen (and unblocked in strict mode)
meanwhile: the first eager call of two threads at once, each compiling flex's internal wrapper.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import logging
import sys
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import wrapt

from fusionguard.core import frames
from fusionguard.core import profiler as profiling
from fusionguard.core.config import Runtime, RuntimeRef
from fusionguard.core.state import STATE, count, dense_allowed_here, guarded, internal_error, write_stderr
from fusionguard.core.tensors import tensor_fields
from fusionguard.dense import causes, lse
from fusionguard.dense import memory as dense_memory
from fusionguard.dense.dynamo_signals import SIGNALS
from fusionguard.errors import DenseFallbackError
from fusionguard.eventlog.crash import sigterm_pending
from fusionguard.eventlog.formatting import human_bytes, site_text
from fusionguard.eventlog.kinds import CAUSES
from fusionguard.eventlog.messages import dense_text
from fusionguard.torch_internals import (
    debug_flag_on,
    dynamo_skips_frames,
    eval_frame_callback,
    is_concrete,
    is_fullgraph_hook,
    nested_flex_codes,
)
from fusionguard.watching import naming, paths

# Set by FlexAttentionAutogradOp.forward's wrapper: the dense forward drops its record here so
# that ctx (and so the backward, possibly on another thread) can carry it.
_FORWARD_SLOT: contextvars.ContextVar[Optional[List[dict]]] = contextvars.ContextVar("fusionguard_forward_slot", default=None)
# Set by FlexAttentionAutogradOp.backward's wrapper: the forward's record, for the dense backward.
_BACKWARD_ORIGIN: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("fusionguard_backward_origin", default=None)

# (a constant True only inside Dynamo's trace; never is_compiling(), a process-wide flag: see above)
_is_dynamo_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)

# The original dense kernels, by phase, for calls routed out of a Dynamo graph (see below).
# Set while a dense call that Dynamo tried to inline runs out of graph: the trace-time note.
_INLINED: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("fusionguard_inlined", default=None)
_TOKENS = itertools.count(1)


def _note_inlined(phase: str) -> int:
    """Runs at *trace time* when Dynamo inlines a dense FlexAttention kernel into a graph.

    That happens when Dynamo cannot capture flex_attention as one operator (e.g. a score_mod
    or mask_mod that graph-breaks): it then traces PyTorch's dense implementation op by op, and
    the score matrix is materialised inside the compiled graph, where no operator hook can see
    it. We log it once per trace and return a token; the wrapper then calls the dense kernel out
    of graph, so every execution is checked (and strict mode can stop it) like an eager call.
    Returns 0 when the guard is off: the graph is then exactly what it would be without us.
    """
    if not STATE.enabled:
        return 0
    info: Dict[str, Any] = {"phase": phase}
    try:
        # Dynamo's graph-break reasons recorded since this frame's compile began (the first is
        # usually the root cause, e.g. a print in score_mod), never another frame's; and the
        # frames it gave up on meanwhile (none of PyTorch's or fusionguard's own).
        reasons, failed, error = SIGNALS.this_frame(sys._getframe(1))
        if error is not None:  # the caller's compile failed: its error is the cause, not a graph break
            info["cause"] = "compile_error"
            info["error"] = error.get("error") or error.get("reason")
        else:
            info["graph_breaks"] = reasons[:3] if reasons else "not known"
        if failed:
            info["frames"] = failed[-3:]
    except Exception:
        info["graph_breaks"] = "not known"
    token = next(_TOKENS)
    notes = STATE.caches.inline_notes
    notes[token] = info
    while len(notes) > 1024:  # bounded: drop the oldest notes
        notes.pop(next(iter(notes)))
    STATE.log.emit("warning", "flex_inlined", path="dense", traced=True, **{"cause": "graph_break", **info})
    return token


def _make_note(phase: str) -> Callable[[], int]:
    # No arguments: Dynamo calls an assume_constant_result function at trace time and bakes in
    # the result, so the phase is closed over, not passed.
    def note() -> int:
        with guarded("inlined dense note"):
            return _note_inlined(phase)
        return 0

    note.__name__ = f"fusionguard_note_inlined_{phase}"
    return note


def _dense_out_of_graph(token: int, phase: str, *args: Any, **kwargs: Any) -> Any:
    """Runs eagerly (``torch._dynamo.disable``): the dense kernel with real tensors, guarded."""
    tok = _INLINED.set(STATE.caches.inline_notes.get(token, {"phase": phase}))
    try:
        return _WRAPPERS[phase](*args, **kwargs)
    finally:
        _INLINED.reset(tok)


_WRAPPERS: Dict[str, Callable[..., Any]] = {}
_NOTE = {phase: _make_note(phase) for phase in ("forward", "backward")}
try:  # trace-time hook and out-of-graph call, both Dynamo's own mechanisms
    _NOTE = {k: torch.compiler.assume_constant_result(v) for k, v in _NOTE.items()}
    _dense_out_of_graph_disabled = torch.compiler.disable(_dense_out_of_graph)
except Exception:  # pragma: no cover - very old torch
    _dense_out_of_graph_disabled = None


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


@functools.lru_cache(maxsize=64)
def _device_name(index: int) -> str:
    # get_device_name reads the device properties: not a per-call cost on the dense path.
    return torch.cuda.get_device_name(index)


# The logsumexp storages of allowed dense forwards: what marks the forward for a backward that
# carries no ctx record (an AOTAutograd-compiled backward, e.g. aot_eager, gets that very tensor
# as its ``logsumexp`` argument). Weak and by identity: a freed storage can never match another.
_ALLOWED_FORWARDS: "weakref.WeakSet[Any]" = weakref.WeakSet()


@guarded("allowed forward mark")
def _mark_allowed(result: Any) -> None:
    _ALLOWED_FORWARDS.add(result[1].untyped_storage())


def _of_allowed_forward(args: tuple, kwargs: dict) -> bool:
    lse = _arg(args, kwargs, 4, "logsumexp")
    try:
        return type(lse) is torch.Tensor and lse.untyped_storage() in _ALLOWED_FORWARDS
    except Exception:  # a layout with no plain storage (nested): no mark to go by
        return False


def _allowed(origin: Optional[dict]) -> bool:
    """Exactly: a call made inside an open ``allow_dense()`` block of this thread / task, or the
    backward of a forward that was allowed (its verdict rides on the forward's autograd ctx, so
    it holds on whatever thread autograd runs the backward: CUDA's device threads included).
    A block open in another thread never allows anything here."""
    if dense_allowed_here():
        return True
    return origin is not None and bool(origin.get("allowed"))


def message(event: Dict[str, Any]) -> str:
    """``format_message``, reused when the event equals the phase's previous one (but for its
    ``seq``, ``ts`` and forward link)."""
    same = dict(event)
    for k in _VOLATILE:
        same.pop(k, None)
    last = STATE.caches.messages.get(event.get("phase"))
    if last is not None and last[0] == same:
        return last[1]
    text = format_message(event)
    STATE.caches.messages[event.get("phase")] = (same, text)
    return text


# (free_bytes moves with every call: shown only in a blocked call's message, never cached)
_VOLATILE = frozenset({"seq", "ts", "forward_seq", "thread", "free_bytes"})


def _from_nested(frame: Any, depth: int = 12) -> bool:
    """A jagged NestedTensor call: torch's NJT implementation (2.7 to 2.12) called the dense
    kernel on the packed values a few frames up."""
    codes = nested_flex_codes()
    while codes and frame is not None and depth:
        code = frame.f_code
        for c in codes:  # by identity: hashing a code object walks its bytecode; and no generator
            if code is c:  # (Dynamo traces this check when it inlines the dense kernel, 2.7)
                return True
        frame, depth = frame.f_back, depth - 1
    return False


def format_message(event: Dict[str, Any]) -> str:
    """One-line verdict, then where, what size, why, and what to do."""
    phase = event["phase"]
    layer = f" in {event['layer']}" if event.get("layer") else ""
    size = human_bytes(event.get("scores_bytes"), unknown="unknown size")
    action: str = event.get("action") or ""
    oom = event.get("blocked_by") == "oom"
    head = {
        "raise": f"dense FlexAttention {phase}{layer} blocked before it allocated a {size} score matrix "
        + ("(oom mode: it would not fit)" if oom else "(strict mode)"),
        "warn": f"dense FlexAttention {phase}{layer} is materialising a {size} score matrix",
        "allow": f"dense FlexAttention {phase}{layer} allowed by "
        + ("the debug flag" if event.get("cause") == "debug_flag" else "allow_dense()")
        + f" ({size} score matrix)",
    }.get(action, f"dense FlexAttention {phase}{layer}")
    q, kv = event.get("q_shape"), event.get("kv_shape")
    dims = ""
    if q and kv:
        dims = f" = B*Hq*Q*KV {q[0]}*{q[1]}*{q[-2]}*{kv[-2]} fp32"
    lines = [
        f"fusionguard: {head}",
        f"  at:       {site_text(event.get('call_site'), 'unknown call site')}",
        f"  shapes:   q {q} k/v {kv} {event.get('dtype')} on {event.get('device')}; scores {size}{dims}",
        f"  traced:   {'yes, by torch.compile' if event.get('traced') else 'no, not captured by torch.compile'}",
    ]
    if event.get("predicted_bytes") is not None:
        free = event.get("free_bytes")
        lines.append(
            f"  memory:   needs about {human_bytes(event.get('predicted_bytes'))} more"
            + (f"; this process can still get {human_bytes(free)} on the device" if free is not None and action == "raise" else "")
        )
    lines += [
        f"  cause:    {event.get('cause')}: {CAUSES.get(event.get('cause') or 'unknown', '')}",
    ]
    evidence = dict(event.get("evidence") or {})
    if evidence.get("frame"):  # file/line are already in the frame text
        evidence.pop("file", None)
        evidence.pop("line", None)
    evidence.pop("limit_type", None)
    first = [k for k in ("reason", "error", "backend", "switch", "function") if k in evidence]
    ordered = first + [k for k in evidence if k not in first]
    ev = "; ".join(f"{k}={evidence[k]}" for k in ordered if evidence[k] not in (None, "", {}, []))
    if ev:
        lines.append(f"  evidence: {ev}")
    lines.append(f"  fix:      {event.get('fix')}")
    if action == "raise" and event.get("recompute") and event.get("native_thread"):
        lines.append(
            "  (a forward re-run by activation checkpointing during backward, on a thread autograd started: no "
            "allow_dense() block reaches it; to let it run dense on purpose, run the backward on your thread "
            "inside the block: `with fusionguard.allow_dense(), torch.autograd.set_multithreading_enabled(False): "
            "loss.backward()`)"
        )
    elif action == "raise":
        lines.append("  (to let this call run dense on purpose: `with fusionguard.allow_dense(): ...`)")
    return "\n".join(lines)


# What ``threading`` calls a thread it did not create (autograd's device threads, a native worker).
_DUMMY_THREAD: Any = getattr(threading, "_DummyThread", ())


def _foreign_thread() -> bool:
    """True on a thread Python's ``threading`` did not create (autograd's device threads): the
    ``allow_dense()`` block of the code that called ``backward()`` is not visible there."""
    return isinstance(threading.current_thread(), _DUMMY_THREAD)


@guarded("dense memory prediction", fallback=(None, None))
def _memory(rt: Runtime, phase: str, args: tuple, kwargs: dict, q: Any, k: Any) -> Tuple[Optional[int], Optional[int]]:
    """(predicted extra peak bytes of this dense call, what this process's CUDA allocator can still give)."""
    if phase == "forward":
        v, score_mod = _arg(args, kwargs, 2, "value"), _arg(args, kwargs, 3, "score_mod")
        buffers, mask_buffers = _arg(args, kwargs, 7, "score_mod_other_buffers"), _arg(args, kwargs, 8, "mask_mod_other_buffers")
    else:
        v, score_mod = _arg(args, kwargs, 2, "value"), _arg(args, kwargs, 7, "fw_graph")
        buffers, mask_buffers = _arg(args, kwargs, 12, "score_mod_other_buffers"), _arg(args, kwargs, 13, "mask_mod_other_buffers")
    predicted = dense_memory.predict_dense(phase, q, k, v, score_mod, buffers or (), mask_buffers or ())
    # (asking the driver, cudaMemGetInfo, costs about 0.8 ms on the H200: done here only where
    # the oom mode decides by it; otherwise only for the events written whole, below)
    return predicted, dense_memory.free_bytes(q.device) if rt.mode == "oom" else None


@guarded("dense free memory")
def _free(q: Any) -> Optional[int]:
    return dense_memory.free_bytes(q.device)


def _wont_fit(rt: Runtime, predicted: Optional[int], free: Optional[int]) -> bool:
    """The oom mode's test: only a call known not to fit (both numbers known) is blocked."""
    return rt.mode == "oom" and predicted is not None and free is not None and predicted > free


def oom_cannot_act(rt: Runtime, free: Optional[int], device: Any) -> None:
    """The oom mode reads what the device can still give, which only CUDA tells: where it cannot
    (CPU, MPS), it blocks nothing and warns as warn mode does; said once per process (#32)."""
    if rt.mode != "oom" or free is not None:
        return
    kind = str(getattr(device, "type", device))
    key = ("oom mode cannot act", kind)
    if key in STATE.reported:
        return
    STATE.reported.add(key)
    write_stderr(
        f"fusionguard: oom mode cannot act on {kind}: it blocks a dense call or mask build predicted not to fit in "
        f"the device's free memory, which only CUDA reports; on {kind} every one runs and is warned about as in "
        "warn mode (use strict mode to block them)\n"
    )


def _check_dense(rt: Runtime, phase: str, args: tuple, kwargs: dict, frame: Any) -> Tuple[Optional[Dict[str, Any]], Any]:
    """(the dense call's event, the user's frame that made the call when the walk found it).
    ``rt``: the settings the wrapper read once for this call (every decision here is by them)."""
    q = _arg(args, kwargs, 0, "query")
    k = _arg(args, kwargs, 1, "key")
    if not is_concrete(q):
        return None, None  # tracing (fake / functional / meta): nothing really runs
    origin = _BACKWARD_ORIGIN.get() if phase == "backward" else None
    inlined = _INLINED.get()
    if inlined is not None:
        cause = inlined.get("cause", "graph_break")
        how = (
            "compiling the calling function failed; Dynamo then traced flex_attention's dense implementation"
            if cause == "compile_error"
            else "Dynamo could not capture flex_attention as one operator and traced its dense implementation"
        )
        diagnosis = causes.Diagnosis(False, cause, {"how": how, **{k: v for k, v in inlined.items() if k not in ("phase", "cause")}})
        call_site = frames.user_call_site(frame)
    elif phase == "forward":
        diagnosis = causes.diagnose_forward(frame)
        call_site = frames.frame_site(diagnosis.site) if diagnosis.site is not None else frames.user_call_site(frame)
    else:
        diagnosis = causes.diagnose_backward(origin, frame)
        call_site = (origin or {}).get("call_site") or frames.user_call_site(frame)
    layer = (origin or {}).get("layer") if phase == "backward" and origin else naming.note_flex_call(frame if phase == "forward" else None)
    if not (phase == "backward" and origin):  # a graph run op by op (aot_eager): named by its node
        layer = naming.graph_layer(frame) or layer
    if layer is None and phase == "forward" and frame is not None and not naming.is_watching():
        layer = paths.caller_name(frame)  # (no watch(): the module whose forward made the call)
    # The debug flag is the user asking for the dense path, as allow_dense() is: logged, never
    # warned about or blocked.
    allowed = (
        _allowed(origin)
        or diagnosis.cause == "debug_flag"
        or (phase == "backward" and origin is None and _of_allowed_forward(args, kwargs))
    )
    predicted, free = _memory(rt, phase, args, kwargs, q, k)
    if not allowed:
        oom_cannot_act(rt, free, getattr(q, "device", None))
    action = "allow" if allowed else ("raise" if rt.strict or _wont_fit(rt, predicted, free) else "warn")
    fields: Dict[str, Any] = {
        "phase": phase,
        "path": "dense",
        "traced": diagnosis.traced,
        "cause": diagnosis.cause,
        "evidence": diagnosis.evidence,
        "fix": diagnosis.fix,
        "layer": layer,
        "allowed": allowed,
        "action": action,
        "mode": rt.mode,
        "call_site": call_site,
        "autograd": origin is not None or _FORWARD_SLOT.get() is not None,
        "predicted_bytes": predicted,
        "free_bytes": free,
    }
    if action == "raise" and not rt.strict:
        fields["blocked_by"] = "oom"  # the oom mode: predicted not to fit
    if free is None and q.is_cuda and STATE.log.written_in_full("flex_call", fields):
        fields["free_bytes"] = _free(q)  # (a sampled-out repeat skips the driver call)
    fields.update(tensor_fields(q, k))
    if "layout" not in fields and _from_nested(frame):
        fields["layout"] = "nested"
    if origin is not None:
        fields["forward_seq"] = origin.get("seq")
    if phase == "forward":
        scale = lse.wrong_scale(_arg(args, kwargs, 6, "kernel_options"), frame)
        if scale is not None:
            fields["lse_scale"] = scale  # a FLASH call's LSE, wrong on this release (measured)
    if q.is_cuda and torch.cuda.is_initialized():
        fields["device_name"] = _device_name(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if phase == "forward" and naming.in_backward():
        fields["recompute"] = True  # activation checkpointing re-running a forward in backward
        if action == "raise" and _foreign_thread():  # (looked at only when it is blocked)
            fields["native_thread"] = True  # autograd's own thread (CUDA's device threads)
    count(f"dense_{phase}")
    STATE.stats.on_dense(layer, phase, diagnosis.cause, fields.get("scores_bytes"), bool(fields.get("recompute")), allowed)
    site = call_site or {}
    key = (phase, site.get("file"), site.get("line"), layer, action, diagnosis.cause)
    durable = rt.fsync == "always" or key not in STATE.durable_keys
    if durable and rt.fsync and len(STATE.durable_keys) < 10_000:
        STATE.durable_keys.add(key)
    logged = STATE.log.emit("warning", "flex_call", durable=durable, **fields)
    # Decide from what we built, never from the log's "latest" event (another thread's, maybe).
    # (a sampled-out call gets {} or the counter event that replaced it: not this call's seq)
    event = {**logged, **fields} if logged and logged.get("event") == "flex_call" else dict(fields)
    slot = _FORWARD_SLOT.get()
    if phase == "forward" and slot is not None:
        slot.append(
            {
                "traced": diagnosis.traced,
                "cause": diagnosis.cause,
                "evidence": diagnosis.evidence,
                "allowed": allowed,
                "call_site": call_site,
                "layer": layer,
                "seq": event.get("seq"),
            }
        )
    return event, (diagnosis.site if phase == "forward" else None)


def _while_ending(rt: Runtime, phase: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A dense call while SIGTERM is handled: the ``shutdown`` event is (being) written with the
    counts so far, and no event may follow it (docs/guarantees.md), so the call is neither counted
    nor logged; strict mode still blocks what nothing allowed, before it allocates."""
    blocked = False
    with guarded(f"dense {phase} check (SIGTERM pending)"):
        origin = _BACKWARD_ORIGIN.get() if phase == "backward" else None
        blocked = bool(
            rt.strict
            and is_concrete(_arg(args, kwargs, 0, "query"))
            and not (_allowed(origin) or debug_flag_on() or (phase == "backward" and origin is None and _of_allowed_forward(args, kwargs)))
        )
    if blocked:
        raise DenseFallbackError(
            f"fusionguard: dense FlexAttention {phase} blocked before it allocated (strict mode); the process is "
            "ending on SIGTERM, so the call is not logged (to let it run dense on purpose: `with fusionguard.allow_dense(): ...`)",
            {"phase": phase, "path": "dense", "action": "raise", "sigterm": True},
        )
    return original(*args, **kwargs)


def make_dense_wrapper(phase: str, runtime: RuntimeRef, original: Callable[..., Any]) -> Callable[..., Any]:
    """The dense kernel's wrapper; ``runtime`` is ``STATE.runtime``: its settings are read once
    per call (``runtime.now``) and handed down."""
    note = _NOTE[phase]

    def fusionguard_dense_kernel(*args: Any, **kwargs: Any) -> Any:
        if _is_dynamo_compiling():
            # Dynamo is inlining the dense implementation into a graph (see _note_inlined).
            token = note()
            if token and _dense_out_of_graph_disabled is not None:
                return _dense_out_of_graph_disabled(token, phase, *args, **kwargs)
            return original(*args, **kwargs)
        rt = runtime.now  # one read per call: on/off and the settings together
        if not rt.enabled or lse.measuring():  # (tracing: told by the tensors, in _check_dense)
            return original(*args, **kwargs)
        if sigterm_pending():  # the process is ending: its shutdown event has the last counts
            return _while_ending(rt, phase, original, args, kwargs)
        blocked = warning = site = lse_warning = None
        mark = False
        event: Optional[Dict[str, Any]] = None
        try:  # (plain try: every eager call) the messages are built in here too: a bug in them must not reach the user's call
            event, site = _check_dense(rt, phase, args, kwargs, sys._getframe(1))
            if event is not None:
                action = event.get("action")
                mark = phase == "forward" and action == "allow"
                if action == "raise":
                    blocked = DenseFallbackError(format_message(event), event)
                elif action == "warn":
                    warning = message(event)
                if action != "raise" and event.get("lse_scale"):
                    lse_warning = lse.message(event["lse_scale"])
                if "seq" in event and (blocked or warning):  # logged in full: also for logging's handlers
                    dense_text(str(blocked) if blocked else str(warning), logging.ERROR if blocked else logging.WARNING)
        except Exception as exc:
            internal_error(f"dense {phase} check", exc)
        if blocked is not None:
            if event is not None and profiling.recording():  # where it stopped, in the timeline
                profiling.mark(functools.partial(profiling.dense_name, event))
            raise blocked
        if warning is not None:
            frames.warn_at_user_line(warning, site)  # outside: a warnings filter set to "error" raises on purpose
        if lse_warning is not None:
            frames.warn_at_user_line(lse_warning, site, RuntimeWarning)
        if event is not None and profiling.recording():  # a range in the profiler's timeline, every call
            result = profiling.in_range(functools.partial(profiling.dense_name, event), original, *args, **kwargs)
        else:
            result = original(*args, **kwargs)
        if mark:
            _mark_allowed(result)
        return result

    fusionguard_dense_kernel.__wrapped__ = original  # type: ignore[attr-defined]
    fusionguard_dense_kernel.__name__ = getattr(original, "__name__", "dense_kernel")
    _WRAPPERS[phase] = fusionguard_dense_kernel
    return fusionguard_dense_kernel


@guarded("Dynamo frame skip")
def _skip_frames(fn: Callable[..., Any], nested: bool) -> None:
    dynamo_skips_frames(fn, nested)


def _hook_free(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(...)`` with no frame below compiled by Dynamo's frame hook (marked once, below)."""
    return fn(*args, **kwargs)


_skip_frames(_hook_free, nested=True)
_skip_frames(is_fullgraph_hook, nested=True)
_skip_frames(is_concrete, nested=True)  # never a frame Dynamo compiles (it gave up on it, a record of ours, #35)
_frame_hook = eval_frame_callback()


def make_autograd_forward(original: staticmethod) -> wrapt.FunctionWrapper:
    """The autograd op's ``forward`` (a staticmethod: wrapt binds it as one, so ``fn`` gets
    ``(ctx, query, ...)``), its verdict linked to ``ctx`` for the backward."""
    runtime = STATE.runtime

    def forward(fn: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
        hook = _frame_hook()  # PyTorch's own fullgraph wrapper runs uncompiled above (torch 2.7):
        if hook and is_fullgraph_hook(hook):  # run as its graph would, with the hook off
            return _hook_free(forward, fn, _instance, args, kwargs)
        if not runtime.now.enabled or len(args) < 2 or not is_concrete(args[1]):
            return fn(*args, **kwargs)
        slot: List[dict] = []
        token = _FORWARD_SLOT.set(slot)
        try:
            out = fn(*args, **kwargs)
        finally:
            _FORWARD_SLOT.reset(token)
        if slot:
            with guarded("autograd forward link"):
                args[0]._fusionguard = slot[-1]  # (args[0]: ctx)
        return out

    _skip_frames(forward, nested=False)  # compiling it alone gains nothing: a graph break at fn
    return wrapt.FunctionWrapper(original, forward)


def make_autograd_backward(original: staticmethod) -> wrapt.FunctionWrapper:
    def backward(fn: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
        if not args:
            return fn(*args, **kwargs)
        origin = getattr(args[0], "_fusionguard", None)  # (args[0]: ctx)
        if origin is None:
            return fn(*args, **kwargs)
        token = _BACKWARD_ORIGIN.set(origin)
        try:
            return fn(*args, **kwargs)
        finally:
            _BACKWARD_ORIGIN.reset(token)

    return wrapt.FunctionWrapper(original, backward)
