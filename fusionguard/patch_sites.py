"""The patch table: every seam fusionguard installs at ``enable()``, one flat function each,
all through the one registry (``STATE.patches``), each with its undo.

Imports the torch side of the package (guard, inductor, watching, rescue): it is imported by
``enable()`` only, so ``import fusionguard`` stays torch-free (the pytest plugin and the
start-up hook rely on that).

The wrappers that decide by ``enable()``'s options (dense kernels, mask builds, rescue, recompile
pressure) close over ``STATE.runtime``: they read its ``now`` (a frozen ``Runtime``) once per
call and hand it down; a second ``enable()`` swaps ``now`` in one assignment.

Attribute sites (a class attribute or a module global) get a ``wrapt.FunctionWrapper``:
descriptor-correct for staticmethods and methods, ``__wrapped__``, name, signature and doc of
the original kept. Two kinds stay plain functions, each said at its installer: where Dynamo must
run our wrapper's own body while it traces (a wrapt proxy passes for the function it wraps, so
Dynamo inlines the original and skips ours), and dict entries (a dispatch table's value is called,
never looked up on an owner: nothing for a descriptor to bind). docs/internals.md has the matrix.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Tuple

import torch

from fusionguard import torch_internals as ti
from fusionguard._summary import log_summary
from fusionguard.core.registry import PatchRegistry
from fusionguard.core.state import STATE, emit, guarded, internal_error
from fusionguard.dense import guard, masks, pressure, rescue
from fusionguard.dense.dynamo_signals import SIGNALS
from fusionguard.eventlog.messages import LOGGER_NAME
from fusionguard.fused import inductor
from fusionguard.watching import naming


def _dense(reg: PatchRegistry, op_name: str, phase: str) -> None:
    """The dense kernel of one higher-order operator (``py_kernels``: Dynamo may trace it).
    Plain: a dict entry, and Dynamo must trace our body to note a dense kernel it inlines."""
    op = ti.hop(op_name)
    ti.dense_kernel(op)
    reg.apply(
        f"{op_name}.CompositeExplicitAutograd",
        ti.op_kernels(op),
        ti.dense_key(),
        functools.partial(guard.make_dense_wrapper, phase, STATE.runtime),
        after=functools.partial(ti.clear_dispatch_cache, op),
    )


def _dense_forward(reg: PatchRegistry) -> None:
    _dense(reg, "flex_attention", "forward")


def _dense_backward(reg: PatchRegistry) -> None:
    _dense(reg, "flex_attention_backward", "backward")


def _autograd_op(reg: PatchRegistry) -> None:
    cls = ti.autograd_op()
    reg.apply("FlexAttentionAutogradOp.forward", vars(cls), "forward", guard.make_autograd_forward, owner=cls)
    reg.apply("FlexAttentionAutogradOp.backward", vars(cls), "backward", guard.make_autograd_backward, owner=cls)


def _lowerings(reg: PatchRegistry) -> None:
    # the lowerings: plain (entries of Inductor's dict, called from it); the template selectors
    # (module globals): wrapt
    table = ti.lowerings()
    ops = ((torch.ops.higher_order.flex_attention, "forward"), (torch.ops.higher_order.flex_attention_backward, "backward"))
    for op, phase in ops:
        if op not in table:
            raise LookupError(f"no Inductor lowering registered for {op}")
        reg.apply(f"inductor.lowerings[{op}]", table, op, functools.partial(inductor.make_lowering_wrapper, phase))
    mod = ti.flex_lowering_module()
    for fn_name, template in ti.TEMPLATE_SELECTORS.items():
        if callable(mod.__dict__.get(fn_name)):
            reg.apply(
                f"inductor.{mod.__name__}.{fn_name}", mod.__dict__, fn_name, functools.partial(inductor.make_selector_wrapper, template)
            )


def _post_compile(reg: PatchRegistry) -> None:
    cls = ti.compiled_fx_graph()
    reg.apply(f"inductor.CompiledFxGraph.{ti.POST_COMPILE}", vars(cls), ti.POST_COMPILE, inductor.make_post_compile_wrapper, owner=cls)


def _signals(reg: PatchRegistry) -> None:
    SIGNALS.connect(emit, internal_error)
    SIGNALS.install(reg)


def _pressure(reg: PatchRegistry) -> None:
    """Recompile pressure: Dynamo's FlexAttention tracing method counts the compiles of the frame
    being compiled (compile time only)."""
    cls, name = ti.flex_trace_method()
    reg.apply(
        f"FlexAttentionHigherOrderVariable.{name}",
        vars(cls),
        name,
        functools.partial(pressure.make_trace_wrapper, STATE.runtime),
        owner=cls,
    )


def _compile_wrappers(reg: PatchRegistry) -> None:
    cls = ti.optimized_module()
    reg.apply("OptimizedModule.__init__", vars(cls), "__init__", naming.make_wrapper_init, owner=cls)


def _rescue(reg: PatchRegistry) -> None:
    home = ti.setup_compilation_env_home()
    reg.apply(
        f"flex_attention.{ti.SETUP_COMPILATION_ENV}",
        home,
        ti.SETUP_COMPILATION_ENV,
        functools.partial(rescue.make_setup_env_wrapper, STATE.runtime),
    )


def _mask_build(reg: PatchRegistry) -> None:
    """The ``create_mask`` global that every ``create_block_mask`` calls (``masks``). Plain, not
    wrapt: under ``torch.compile(create_block_mask)`` Dynamo must trace our body (its trace-time
    record); a wrapt proxy it would see through to the original (tests/test_masks.py)."""
    reg.apply("flex_attention.create_mask", ti.mask_home(), "create_mask", functools.partial(masks.make_create_mask_wrapper, STATE.runtime))


def _torch_logs(reg: PatchRegistry) -> None:
    """``TORCH_LOGS=fusionguard`` sets the level of ``logging.getLogger("fusionguard")``."""
    undo = ti.register_torch_log(LOGGER_NAME, LOGGER_NAME)
    if undo is not None:
        reg.add_hook("torch._logging.register_log(fusionguard)", undo, lambda: not ti.torch_log_registered(LOGGER_NAME))


#: (the name ``not_patched`` reports it under, its installer), in installation order.
PATCHES: Tuple[Tuple[str, Callable[[PatchRegistry], None]], ...] = (
    ("flex_attention (dense forward)", _dense_forward),
    ("flex_attention_backward (dense backward)", _dense_backward),
    ("FlexAttentionAutogradOp", _autograd_op),
    ("inductor lowerings", _lowerings),
    ("inductor CompiledFxGraph.post_compile", _post_compile),
    ("dynamo signals", _signals),
    ("recompile pressure (dynamo)", _pressure),
    ("torch.compile module wrapper (watch)", _compile_wrappers),
    ("rescue (setup_compilation_env)", _rescue),
    ("mask builds (create_mask)", _mask_build),
    ("torch._logging (TORCH_LOGS=fusionguard)", _torch_logs),
)


def install_patches() -> List[str]:
    """Install every patch; returns the names of features this torch release lacks (recorded in
    ``STATE.not_patched`` too, with the sentence that says what is unavailable); a failure of any
    other kind is recorded there as what could not be patched."""
    unavailable: List[str] = []
    for name, install in PATCHES:
        try:
            install(STATE.patches)
        except ti.Unavailable as exc:  # the release lacks it: nothing to guard there
            STATE.not_patched[name] = str(exc)
            unavailable.append(name)
        except Exception as exc:  # version drift: say what could not be patched
            STATE.not_patched[name] = f"{type(exc).__name__}: {exc}"
    return unavailable


def live_graphs() -> Tuple[List[Any], float]:
    """Compiled graphs holding FlexAttention made before this enable() (see inductor)."""
    try:  # (not guarded(): a fresh list per call)
        return inductor.live_flex_graphs()
    except Exception as exc:
        internal_error("search for graphs compiled before enable()", exc)
        return [], 0.0


def unseen_fields(graphs: List[Any]) -> dict:
    """The header's ``unseen_graphs``: graphs compiled before enable() that cannot be named."""
    unseen = inductor.unseen_graphs(graphs)
    return {"unseen_graphs": unseen, "unseen_graphs_fix": inductor.UNSEEN_FIX if unseen else None}


@guarded("graphs compiled before enable()")
def adopt_live_graphs(graphs: List[Any], search_ms: float) -> None:
    inductor.adopt_live_graphs(graphs, search_ms)


def new_log_stats() -> None:
    """Summary rows are the log's: a new file counts its own calls only."""
    STATE.stats.new_log()


def final_events(reason: str, **extra: Any) -> None:
    """The per-layer summary and the shutdown event that end a log (disable, exit, a new log_path)."""
    log_summary()
    STATE.log.emit("info", "shutdown", reason=reason, **extra, counts=dict(STATE.counts))
