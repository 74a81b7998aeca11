"""watch() and compiled graphs (watching/, fused/inductor.py, fused/runs.py), the profiler's flag,
mask builds and context parallelism."""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Dict, Optional, Tuple

from fusionguard.torch_internals.lookups import module, public_module
from fusionguard.torch_internals.names import (
    COMPILED_CALL_IMPL,
    CONTEXT_PARALLEL,
    CP_BLOCK_MASK,
    CP_MODULES,
    CP_SHARD,
    DEFAULT_BLOCK_SIZE,
    DISABLE_CONTEXT,
    EXTRA_DICT_REF,
    FORWARD_HOOK_DICTS,
    GRAPH_TASK_ID,
    HOOKS_DICT_REF,
    MODULES,
    ORIG_CALLABLE,
    ORIG_MOD,
    PROFILER_FLAG,
    PUBLIC_MODULE,
    Unavailable,
    torch_version,
)

# --- watch() and compiled graphs (watching/, fused/inductor.py, fused/runs.py) ----------------


def graph_task_id() -> Any:
    """A function returning the id of the autograd backward pass running on this thread, -1
    outside one (``torch._C._current_graph_task_id``); on a torch without it, always -1."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    return getattr(torch._C, GRAPH_TASK_ID, None) or (lambda: -1)


def at_trace_time(fn: Any) -> Any:
    """``fn`` (no arguments, returns an int) run for real when Dynamo traces a call to it, the
    result baked into the graph as a constant (``torch._dynamo.assume_constant_result``);
    without that Dynamo support, a function that does nothing."""
    try:
        import torch._dynamo  # lazy: torch loads on first use, never when this module is imported

        return torch._dynamo.assume_constant_result(fn)
    except Exception:  # pragma: no cover - very old torch
        return lambda: 0


def hooks_home(handle: Any) -> Callable[[], Any]:
    """A hook handle's weak reference to the dict that holds its hook (``hooks_dict_ref``)."""
    return getattr(handle, HOOKS_DICT_REF)


def hook_dicts(handle: Any) -> "list[Any]":
    """The dicts a hook handle's registration wrote in: its hook dict, then its extra dicts
    (with_kwargs, always_call), as weak-reference results (None where a dict is gone)."""
    return [ref() for ref in (getattr(handle, HOOKS_DICT_REF), *getattr(handle, EXTRA_DICT_REF))]


def hook_marks(handle: Any) -> Tuple[Any, ...]:
    """What registering put in the handle's extra dicts (with_kwargs, always_call) under its id:
    ``(weak reference to the dict, value)`` pairs; () where the handle does not say."""
    try:
        return tuple((ref, ref()[handle.id]) for ref in getattr(handle, EXTRA_DICT_REF) if handle.id in (ref() or {}))
    except Exception:
        return ()


def reinsert_hook(handle: Any, fn: Callable[..., Any], marks: Tuple[Any, ...]) -> bool:
    """Put a removed hook back under its old id, as registering put it (the hook in the
    handle's dict, the same values in its extra dicts: ``marks``, from ``hook_marks``). Why:
    Dynamo guards on the ids of always-called hooks, so a new registration (a new id) at each
    watch() entry recompiled every step. False where the handle does not look like that
    (another torch): the caller registers anew."""
    try:
        hooks = getattr(handle, HOOKS_DICT_REF)()
        if hooks is None or not marks or any(ref() is None for ref, _ in marks):
            return False
        hooks[handle.id] = fn
        for ref, value in marks:
            ref()[handle.id] = value
        return True
    except Exception:
        return False


def drop_hooks(module: Any, hook: Any) -> int:
    """Take every forward (pre-)hook entry of ``module`` whose hook is ``hook`` out of its hook
    dicts, with its flags (with_kwargs, always_call: the same ids); how many were taken out."""
    attrs = module.__dict__
    dropped = 0
    for hooks_name, flag_names in FORWARD_HOOK_DICTS:
        hooks = attrs.get(hooks_name) or {}
        for key in [k for k, v in hooks.items() if v is hook]:
            del hooks[key]
            for name in flag_names:
                (attrs.get(name) or {}).pop(key, None)
            dropped += 1
    return dropped


def is_compile_wrapper(module: Any) -> bool:
    """``torch.compile(module)``'s ``OptimizedModule``: it holds the module as ``_orig_mod``."""
    return hasattr(module, ORIG_MOD) and hasattr(module, ORIG_CALLABLE)


def compiled_in_place(module: Any) -> bool:
    """``module.compile()`` was called: its ``__call__`` runs a compiled ``_call_impl``."""
    return getattr(module, COMPILED_CALL_IMPL, None) is not None


def wrapped_module(wrapper: Any) -> Any:
    """The module an ``OptimizedModule`` (being built) wraps; None for ``torch.compiler.disable(module)``,
    the same class around a ``DisableContext``, which compiles nothing."""
    attrs = wrapper.__dict__
    if type(attrs.get("dynamo_ctx")).__name__ == DISABLE_CONTEXT:
        return None
    return attrs.get(ORIG_MOD) or attrs.get(MODULES, {}).get(ORIG_MOD)


def lowering_node() -> Any:
    """The FX node Inductor is lowering now (``V.graph.current_node``), or None."""
    from torch._inductor.virtualized import V  # lazy: torch loads on first use, never when this module is imported

    return getattr(V.graph, "current_node", None)


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``cache_dir()``: ``runtime.cache_dir_utils``, earlier
    ``runtime.runtime_utils``)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # lazy: torch loads on first use, never when this module is imported
    except ImportError:  # older layout
        from torch._inductor.runtime.runtime_utils import cache_dir  # lazy: torch loads on first use, never when this module is imported
    return str(cache_dir())


def profiler_check() -> Callable[[], bool]:
    """A cheap "is a profiler recording?" for the run-time wrappers (fusionguard.core.profiler):
    ``torch.autograd.profiler._is_profiler_enabled``, the flag ``torch.profiler`` sets (a module
    attribute read, about 0.06 us; an idle ``record_function`` costs about 13 us), else the C
    function behind it (``torch._C._autograd._profiler_enabled``), else never (no ranges)."""
    try:
        prof = module("torch.autograd.profiler")
    except ImportError:
        prof = None
    if prof is not None and isinstance(getattr(prof, PROFILER_FLAG, None), bool):
        return lambda: prof._is_profiler_enabled
    try:
        fn = module("torch._C._autograd")._profiler_enabled
        if callable(fn) and isinstance(fn(), bool):
            return fn
    except (ImportError, AttributeError):
        pass
    return lambda: False


def attn_implementation(model: Any) -> Optional[str]:
    """A Hugging Face model's attention backend (``config._attn_implementation``: transformers has
    no public name for it), or None. Kept here with the other private names."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def mask_home() -> Dict[str, Any]:
    """The namespace whose ``create_mask`` global ``create_block_mask`` calls (the mask hook's
    seam: every ``create_block_mask``, however it was imported, looks it up there)."""
    mod = public_module()
    if mod is None or not callable(mod.__dict__.get("create_mask")) or not callable(mod.__dict__.get("create_block_mask")):
        raise Unavailable(f"mask builds are not observed on torch {torch_version()} ({PUBLIC_MODULE}.create_mask is missing)")
    return mod.__dict__


def create_block_mask_code() -> Any:
    """``create_block_mask``'s code object (to tell its ``create_mask`` call from a direct one)."""
    mod = public_module()
    fn = mod.__dict__.get("create_block_mask") if mod is not None else None
    fn = getattr(fn, "__wrapped__", fn)
    return getattr(fn, "__code__", None)


def block_sizes(frame: Any) -> Tuple[int, int]:
    """The (Q, KV) sparse block sizes ``create_block_mask`` (``frame``) is building with; its
    locals ``Q_BLOCK_SIZE`` / ``KV_BLOCK_SIZE``, else the module default (128)."""
    try:
        local = frame.f_locals
        return int(local["Q_BLOCK_SIZE"]), int(local["KV_BLOCK_SIZE"])
    except Exception:
        mod = public_module()
        size = int(getattr(mod, DEFAULT_BLOCK_SIZE, 128))
        return size, size


def _cp_block_mask(build: Callable[..., Any]) -> Callable[..., Any]:
    """``_create_cp_block_mask`` called one way on every release: 2.15 added a required
    ``BLOCK_SIZE`` before ``device_mesh`` (2.11 to 2.14 have none), so the mesh goes by keyword
    and the block size (default: the module's, 128) only where the signature names it."""
    try:
        takes_block_size = "BLOCK_SIZE" in inspect.signature(build).parameters
    except (TypeError, ValueError):
        takes_block_size = False

    def create_cp_block_mask(
        mask_mod: Callable[..., Any],
        B: int,
        H: int,
        Q_LEN: int,
        KV_LEN: int,
        device_mesh: Any,
        block_size: Optional[Tuple[int, int]] = None,
        **kwargs: Any,
    ) -> Any:
        if takes_block_size:
            size = int(getattr(public_module(), DEFAULT_BLOCK_SIZE, 128))
            kwargs["BLOCK_SIZE"] = block_size or (size, size)
        return build(mask_mod, B, H, Q_LEN, KV_LEN, device_mesh=device_mesh, **kwargs)

    return create_cp_block_mask


def context_parallel_flex() -> types.SimpleNamespace:
    """PyTorch's private context parallelism for FlexAttention: ``ContextParallel`` (the
    ``ParallelStyle``; ``ContextParallel(seq_dim, ContextParallel.AttentionType.FLEX)``),
    ``create_cp_block_mask`` and ``shard`` (``_context_parallel_shard``), from the first of
    ``CP_MODULES`` that has all three (tests/gpu/dist_cuda_worker.py, docs/distributed.md).

    Raises ``Unavailable`` where this release has none of the three in any of them (torch 2.7: its
    context parallelism knows SDPA only), ``LookupError`` where some are there but not all (a
    changed API: a failure to look into, never a release that simply lacks it)."""
    errors, seen = [], []
    for name in CP_MODULES:
        try:
            mod = module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        found = [mod.__dict__.get(n) for n in (CONTEXT_PARALLEL, CP_BLOCK_MASK, CP_SHARD)]
        if all(callable(f) for f in found) and hasattr(found[0], "AttentionType"):
            build: Callable[..., Any] = found[1]  # type: ignore[assignment]  # (callable: checked above)
            return types.SimpleNamespace(ContextParallel=found[0], create_cp_block_mask=_cp_block_mask(build), shard=found[2])
        seen += [f"{name}.{n}" for n, f in zip((CONTEXT_PARALLEL, CP_BLOCK_MASK, CP_SHARD), found) if f is not None]
        errors.append(f"{name}: no {CONTEXT_PARALLEL} with AttentionType, {CP_BLOCK_MASK} and {CP_SHARD}")
    if not seen:
        raise Unavailable(
            f"torch {torch_version()} has no context parallelism for FlexAttention "
            f"(none of {CONTEXT_PARALLEL}, {CP_BLOCK_MASK}, {CP_SHARD} in {', '.join(CP_MODULES)})"
        )
    raise LookupError(f"context parallelism for FlexAttention not found (found only {', '.join(seen)}): " + "; ".join(errors))
