"""The event kinds a fusionguard log holds: one list, the subsets that other modules act on.

Dependency-free (``crash`` is also loaded without the package and without torch)."""

from __future__ import annotations

#: Every kind of event fusionguard writes (``report`` counts anything else as unknown).
KNOWN_EVENTS = frozenset(
    {
        "header", "flex_call", "flex_compile", "flex_inlined", "recompile_limit", "compile_error",
        "graph_break", "internal_error", "shutdown", "layer_memory", "fused_calls", "summary", "crash",
        "flex_run", "rescue_failed", "dense_calls", "watch_traced", "compiled_before_enable",
        "recompile_pressure", "no_flex_calls",
        "mask_build", "mask_builds",
        "partial_names",
    }
)
#: About one FlexAttention call, compile or layer: the "last FlexAttention event" of a crash.
FLEX_EVENTS = frozenset({"flex_call", "flex_compile", "flex_inlined", "layer_memory", "fused_calls", "dense_calls", "flex_run"})
#: Verdicts also put into PyTorch's structured trace (TORCH_TRACE, tlparse).
TRACE_EVENTS = frozenset(
    {"flex_call", "flex_compile", "flex_inlined", "recompile_limit", "recompile_pressure", "compile_error", "graph_break", "rescue_failed"}
)

assert FLEX_EVENTS <= KNOWN_EVENTS and TRACE_EVENTS <= KNOWN_EVENTS
