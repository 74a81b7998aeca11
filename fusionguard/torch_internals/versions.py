"""Version differences, each behind one lookup (torch 2.6 ... 2.15)."""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Dict, Optional

from fusionguard.torch_internals.dynamo import cache_entries
from fusionguard.torch_internals.lookups import module, public_module
from fusionguard.torch_internals.names import (
    CUDAGRAPH_INFO,
    CURRENT_CALLABLE,
    DEBUG_FLAG,
    FX_GRAPH_CACHE_KEY,
    ONE_GRAPH,
    ORIG_BACKEND,
    ORIG_CALLABLE,
    POST_GRAD_GRAPH_STR,
    PUBLIC_MODULE,
    RUNNABLE_GRAPH_STR,
    SOURCE_CODE,
    Unavailable,
    torch_version,
)

# --- Version differences, each behind one lookup (torch 2.6 ... 2.15) -------------------------


def setup_compilation_env_home() -> Dict[str, Any]:
    """The namespace holding ``setup_compilation_env`` (from 2.11), the context manager that
    yields the backend of PyTorch's eager flex_attention compile: rescue's seam."""
    mod = public_module()
    if mod is None or not callable(mod.__dict__.get("setup_compilation_env")):
        raise Unavailable(
            f"rescue=True is unavailable on torch {torch_version()} ({PUBLIC_MODULE}.setup_compilation_env, added in 2.11, is missing)"
        )
    return mod.__dict__


def has_debug_flag() -> bool:
    """``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` exists (from 2.9)."""
    mod = public_module()
    return mod is not None and DEBUG_FLAG in mod.__dict__


def recompile_limit_option() -> str:
    """Dynamo's per-frame recompile limit: ``recompile_limit`` from 2.7, ``cache_size_limit`` on 2.6
    (2.7+ keeps that name as an alias)."""
    import torch._dynamo  # lazy: torch loads on first use, never when this module is imported

    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def backend_name(backend: Any) -> Optional[str]:
    """A Dynamo backend's name: ``inductor``, ``aot_eager``, or the function's own name."""
    if backend is None:
        return None
    if isinstance(backend, str):
        return backend
    return getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or repr(backend)


def _unwrap_backend(callback: Any) -> Any:
    """Dynamo's frame callback wraps the backend in converters that keep it as
    ``_torchdynamo_orig_backend`` (2.8+) or ``_torchdynamo_orig_callable`` (2.6, 2.7)."""
    for _ in range(10):
        inner = getattr(callback, ORIG_BACKEND, None) or getattr(callback, ORIG_CALLABLE, None)
        if inner is None or inner is callback:
            break
        callback = inner
    return callback


def compiled_code_backend(code: types.CodeType, orig: types.CodeType, entry_frame: Optional[types.FrameType]) -> Any:
    """The backend that compiled ``code`` (Dynamo's transformed version of ``orig``).

    From 2.11 its cache entry says (``CacheEntry.backend``); before, the ``torch.compile``
    wrapper frame that was running it (``entry_frame``, the innermost one outside the compiled
    frame) holds the Dynamo callback around the backend."""
    for entry in cache_entries(orig):
        if entry.code is code and hasattr(entry, "backend"):
            return entry.backend
    if entry_frame is not None:
        callback = entry_frame.f_locals.get("callback")
        if callback is not None:
            return _unwrap_backend(callback)
    return None


def compiled_graph_text(compiled: Any, source: bool = False) -> str:
    """The post-grad FX graph Inductor keeps with a ``CompiledFxGraph`` (2.7+), or ``""``;
    ``source``: else the graph's generated Python code."""
    text = getattr(compiled, POST_GRAD_GRAPH_STR, None) or getattr(compiled, RUNNABLE_GRAPH_STR, None)
    if not text and source:
        text = getattr(compiled, SOURCE_CODE, None)
    return text or ""


def graph_callable(compiled: Any) -> Any:
    """The callable every run of a ``CompiledFxGraph`` goes through (``current_callable``), or None."""
    return getattr(compiled, CURRENT_CALLABLE, None)


def graph_callable_is_own(compiled: Any) -> bool:
    """The graph holds that callable in its own ``__dict__`` (it can be wrapped there, and put back)."""
    return CURRENT_CALLABLE in getattr(compiled, "__dict__", {})


def graph_uses_cudagraphs(compiled: Any) -> bool:
    """The graph runs as CUDA graphs (``cudagraph_info`` set)."""
    return bool(getattr(compiled, CUDAGRAPH_INFO, None))


def dynamo_skips_frames(fn: Any, nested: bool) -> bool:
    """Tell Dynamo's frame hook never to compile ``fn``'s own frames (``nested``: nor any frame
    they call, as for a compiled graph's own calls), per code object, at no per-call cost. How
    Dynamo inlines ``fn`` when it traces a caller is unchanged. False where this torch has no such
    switch (``set_code_exec_strategy``, 2.7+)."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )  # lazy: torch loads on first use, never when this module is imported
    except ImportError:
        return False
    action = _FrameAction.SKIP if nested else _FrameAction.DEFAULT
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, action))
    return True


def eval_frame_callback() -> Callable[[], Any]:
    """Dynamo's C function that returns the frame hook set on this thread (None or False when
    none): a C call, so no Python frame of ours for that hook to see."""
    try:
        return module("torch._C._dynamo.eval_frame").get_eval_frame_callback
    except (ImportError, AttributeError):
        return lambda: None


def is_fullgraph_hook(callback: Any) -> bool:
    """``callback`` (a set frame hook) compiles every new frame with ``fullgraph=True``.

    That is the hook below PyTorch's internal ``torch.compile(fullgraph=True)`` flex_attention
    wrapper when Dynamo runs that wrapper uncompiled (torch 2.7, for the rest of the process once a
    compile of it was skipped, e.g. with Dynamo disabled): every frame below it not seen before is
    compiled that way, and the guard's frames cannot be (they leave the graph on purpose). False
    when unsure."""
    inner = getattr(callback, ORIG_CALLABLE, None)  # CatchErrorsWrapper -> ConvertFrameAssert
    return getattr(inner, ONE_GRAPH, None) is True


def graph_cache_key(compiled: Any) -> Optional[str]:
    """The FX graph cache key of a ``CompiledFxGraph`` (``cache_key``; ``_fx_graph_cache_key`` on
    older releases), or None."""
    return getattr(compiled, "cache_key", None) or getattr(compiled, FX_GRAPH_CACHE_KEY, None)


NJT_MODULE = "torch.nested._internal.ops"
_NJT_CODES: tuple = ()


def nested_flex_codes() -> tuple:
    """Code objects of the jagged NestedTensor FlexAttention implementations (``flex_njt``,
    ``flex_njt_backward``; 2.7 to 2.12), which run the dense kernel on the packed values: the
    kernel itself sees a plain tensor. Empty where none exists or no NestedTensor was made."""
    global _NJT_CODES
    if not _NJT_CODES:
        mod = sys.modules.get(NJT_MODULE)
        if mod is not None:
            codes = []  # a loop, not a generator: no new frame on the dense path (a frame hook sees those)
            for name, fn in list(vars(mod).items()):
                if name.startswith("flex_njt") and hasattr(fn, "__code__"):
                    codes.append(fn.__code__)
            _NJT_CODES = tuple(codes)
    return _NJT_CODES
