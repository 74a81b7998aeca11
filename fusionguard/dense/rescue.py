"""Rescue mode: turn PyTorch's own eager FlexAttention compile into a fusing one.

When ``flex_attention`` runs eagerly (no ``torch.compile`` around it, or Dynamo gave up on the
calling function), PyTorch still compiles the operator, with ``backend="eager"``, inside
``setup_compilation_env()``. That context manager is the one clean seam: it *yields* the backend.
Rescue wraps it and yields Inductor instead, so the same internal compile produces the fused
forward and backward kernels. Everything else stays PyTorch's: ``fullgraph=True``, its cache-limit
handling, its automatic dynamic shapes (a new sequence length recompiles once, then the graph is
dynamic).

Never rescued, because the user asked for dense: ``allow_dense()``, a ``torch.compiler.disable``'d
function on the stack, ``set_stance('force_eager')`` and friends, ``TORCHDYNAMO_DISABLE``, the
debug flag (PyTorch then does not compile at all), and calls traced by a user's non-fusing backend
(those never reach this path).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import sys
import time
from typing import Any, Callable, Iterator, Optional

import wrapt

from fusionguard import torch_internals as ti
from fusionguard.core import frames
from fusionguard.core.config import Runtime, RuntimeRef
from fusionguard.core.state import STATE, count, dense_allowed_here, guarded
from fusionguard.core.tensors import tensor_fields
from fusionguard.dense import causes
from fusionguard.watching.naming import flex_layer

RESCUABLE = ("eager_call", "recompile_limit", "graph_break", "compile_error")

# Set while a rescued call runs: its diagnosis, for the event.
RESCUING: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("fusionguard_rescuing", default=None)


def _eager_backend() -> Any:
    return ti.lookup_backend("eager")


def rescue_backend(gm: Any, example_inputs: Any) -> Any:
    """Inductor, or PyTorch's eager backend if Inductor fails: a rescue must never break a call
    that would have worked densely (the dense run is then guarded and logged as usual)."""
    backends = STATE.caches.backends
    if "inductor" not in backends:
        backends["inductor"] = ti.lookup_backend("inductor")
    inductor = backends["inductor"]
    record = RESCUING.get() or {}
    try:
        if record.get("out_only"):
            return _out_only(inductor, gm, example_inputs)
        return inductor(gm, example_inputs)
    except Exception as exc:
        record["failed"] = True  # the call runs densely (and is guarded and logged as such)
        count("rescue_failed")
        try:
            STATE.log.emit("warning", "rescue_failed", error=f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}")
        except Exception:
            pass
        return _eager_backend()(gm, example_inputs)


def _out_only(inductor: Any, gm: Any, example_inputs: Any) -> Any:
    """Compile only the attention output when the caller discards the logsumexp / max outputs.

    PyTorch's eager wrapper graph returns ``(out, lse, max_scores)``; Inductor's CPU template
    produces ``out`` alone (CPU compiles inference only), so the full graph cannot lower there.
    When nothing needs the other two (no grad, no ``return_lse`` / ``return_aux``), compile a copy
    of the graph that returns ``out`` and hand back ``None`` for the rest, which
    ``_finalize_outputs`` accepts."""

    graph_module = copy.copy(gm)
    graph_module.graph = copy.deepcopy(gm.graph)
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (tuple, list)) or len(outs) != 3:
        return inductor(gm, example_inputs)
    output.args = ((outs[0],),)
    graph_module.graph.eliminate_dead_code()
    graph_module.recompile()
    compiled = inductor(graph_module, example_inputs)

    def run(*args: Any) -> Any:
        result = compiled(*args)
        return (result[0], None, None)

    return run


def _dynamic_ok() -> Any:
    try:
        return ti.dynamo_config().patch(automatic_dynamic_shapes=True)
    except Exception:
        return contextlib.nullcontext()


def _caller(frame: Any) -> Any:
    """Skip contextlib's frames (we run inside a generator-based context manager)."""
    f = frame
    while f is not None and (f.f_code.co_filename.endswith("contextlib.py") or f.f_code.co_filename.startswith(frames.FG_DIR)):
        f = f.f_back
    return f


def _user_disabled(frame: Any) -> bool:
    f = frame
    while f is not None:
        if ti.is_disable_wrapper(f.f_code):
            fn = f.f_locals.get("fn")
            code = getattr(fn, "__code__", None)
            if code is not None and not frames.is_torch_file(code.co_filename) and not code.co_filename.startswith("<"):
                return True
        f = f.f_back
    return False


def decide(rt: Runtime, frame: Any) -> Optional[causes.Diagnosis]:
    """The diagnosis if this eager call may be rescued (by the settings ``rt``), else None."""
    if not rt.rescue or dense_allowed_here():
        return None
    if ti.debug_flag_on() or _user_disabled(frame):
        return None
    diagnosis = causes.diagnose_forward(frame)
    return diagnosis if diagnosis.cause in RESCUABLE else None


def _out_only_ok(frame: Any) -> bool:
    """CPU inference that only uses the attention output (read from the public call's locals)."""
    try:
        import torch  # lazy: torch loads on first use, never when this module is imported

        local = frame.f_locals if frame is not None else {}
        q = local.get("query")
        if not isinstance(q, torch.Tensor) or q.device.type != "cpu":
            return False
        if local.get("return_lse") or local.get("return_aux") is not None:
            return False
        tensors = [local.get(n) for n in ("query", "key", "value")]
        return not (torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors))
    except Exception:
        return False


def make_setup_env_wrapper(runtime: RuntimeRef, original: Callable[..., Any]) -> wrapt.FunctionWrapper:
    """``setup_compilation_env``'s wrapper; ``runtime`` is ``STATE.runtime``, read once per call."""

    def fusionguard_rescue_env(wrapped: Callable[..., Any], _instance: Any, args: tuple, kwargs: dict) -> Any:
        return _rescue_env(runtime.now, wrapped, args, kwargs)

    return wrapt.FunctionWrapper(original, fusionguard_rescue_env)


@contextlib.contextmanager
def _rescue_env(rt: Runtime, original: Callable[..., Any], args: tuple, kwargs: dict) -> Iterator[Any]:
    """PyTorch's ``setup_compilation_env`` context, whose backend is swapped for
    ``rescue_backend`` when the eager call is one to rescue."""
    with original(*args, **kwargs) as backend:
        decision = None
        if rt.enabled and rt.rescue:
            with guarded("rescue decision"):
                if backend is _eager_backend():
                    decision = decide(rt, _caller(sys._getframe(0)))
        if decision is None:
            yield backend
            return
        record = {
            "cause": decision.cause,
            "evidence": decision.evidence,
            "compiles_before": STATE.counts.get("fused_compile_forward", 0),
            "t0": time.perf_counter(),
            "out_only": _out_only_ok(_caller(sys._getframe(0))),
        }
        token = RESCUING.set(record)
        try:
            # A user's torch.compile(dynamic=False) around a frame that slid to eager is still
            # in force here: without this, every new sequence length would recompile.
            with _dynamic_ok():
                yield rescue_backend
        finally:
            RESCUING.reset(token)
            with guarded("rescue event"):
                _log_rescue(record, _caller(sys._getframe(0)))


def _log_rescue(record: dict, frame: Any) -> None:
    if record.get("failed"):
        return  # not rescued: the dense run logged its own event
    compiles = STATE.counts.get("fused_compile_forward", 0) - record["compiles_before"]
    seconds = time.perf_counter() - record["t0"]
    count("rescued")
    if compiles:
        count("rescue_compiles", compiles)
        count("rescue_compile_ms", int(seconds * 1000))
    local = frame.f_locals if frame is not None else {}
    tensors = tensor_fields(local.get("query"), local.get("key")) if local.get("query") is not None else {}
    STATE.log.emit(
        "info",
        "flex_call",
        phase="forward",
        path="rescued",
        traced=False,
        cause=record["cause"],
        evidence=record["evidence"],
        layer=flex_layer(frame),
        call_site=frames.user_call_site(frame),
        compiled=bool(compiles),
        compile_s=round(seconds, 3) if compiles else None,
        backward="fused (compiled with the forward)",
        **tensors,
    )
