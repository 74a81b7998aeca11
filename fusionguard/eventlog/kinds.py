"""The event kinds a fusionguard log holds: one list, the subsets that other modules act on.

Also the vocabulary of a dense event's ``cause``: what each means and its fix (the guard's
messages, recompile pressure and ``report`` say the same words), and the ``layer`` of calls no
layer name reaches (``NO_LAYER``). Dependency-free."""

from __future__ import annotations

from typing import Dict

#: The row of FlexAttention calls that no layer name reaches (a dense call outside any watched
#: module, a graph compiled before ``enable()``, a compiled function called from no module):
#: ``summary()``'s, the log's ``summary`` rows and ``fusionguard report``'s, the same words in all.
NO_LAYER = "(no layer)"

#: Every kind of event fusionguard writes (``report`` counts anything else as unknown).
KNOWN_EVENTS = frozenset(
    {
        "header",
        "flex_call",
        "flex_compile",
        "flex_inlined",
        "recompile_limit",
        "compile_error",
        "graph_break",
        "internal_error",
        "shutdown",
        "layer_memory",
        "fused_calls",
        "summary",
        "crash",
        "flex_run",
        "rescue_failed",
        "dense_calls",
        "watch_traced",
        "compiled_before_enable",
        "recompile_pressure",
        "no_flex_calls",
        "mask_build",
        "mask_builds",
        "partial_names",
    }
)
#: About one FlexAttention call, compile or layer: the "last FlexAttention event" of a crash.
FLEX_EVENTS = frozenset({"flex_call", "flex_compile", "flex_inlined", "layer_memory", "fused_calls", "dense_calls", "flex_run"})
#: Verdicts also put into PyTorch's structured trace (TORCH_TRACE, tlparse).
TRACE_EVENTS = frozenset(
    {"flex_call", "flex_compile", "flex_inlined", "recompile_limit", "recompile_pressure", "compile_error", "graph_break", "rescue_failed"}
)

#: A dense call's ``cause`` -> what it means.
CAUSES: Dict[str, str] = {
    "eager_call": "flex_attention was called with no torch.compile around it",
    "non_inductor_backend": "captured by torch.compile, but with a backend that does not fuse FlexAttention",
    "recompile_limit": "Dynamo hit its recompile limit for the calling function and now runs it eagerly",
    "graph_break": "Dynamo broke the graph at or around the call, so it ran in an eager region",
    "compiler_disabled": "compilation is switched off for this call",
    "compile_error": "compiling the calling function failed and Dynamo fell back to eager (suppress_errors)",
    "debug_flag": "torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is set",
    "unknown": "no supported explanation was found",
}

#: A dense call's ``cause`` -> what to do.
FIXES: Dict[str, str] = {
    "eager_call": "wrap the call or the model in torch.compile, e.g. "
    "`flex_attention = torch.compile(flex_attention)` or `model = torch.compile(model)`",
    "non_inductor_backend": "use the default Inductor backend: torch.compile(fn) or backend='inductor'",
    "recompile_limit": "stop the recompiles: mark the varying dim dynamic "
    "(torch._dynamo.mark_dynamic(q, 2) or torch.compile(..., dynamic=True)), bucket/pad sequence "
    "lengths, build the BlockMask outside the compiled function and reuse mask_mod functions; or "
    "raise torch._dynamo.config.recompile_limit",
    "graph_break": "remove the graph break at the call (run with TORCH_LOGS=graph_breaks to see it), "
    "or compile the attention call on its own: torch.compile(flex_attention)",
    "compiler_disabled": "remove the torch.compiler.disable / set_stance('force_eager') / "
    "TORCHDYNAMO_DISABLE=1 / torch._dynamo.config.disable around this call",
    "compile_error": "fix the compile error shown in evidence (set torch._dynamo.config.suppress_errors = False to see the full traceback)",
    "debug_flag": "set torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = False",
    "unknown": "compile the call with torch.compile (Inductor); see the evidence for what was found",
}

assert FLEX_EVENTS <= KNOWN_EVENTS and TRACE_EVENTS <= KNOWN_EVENTS and set(CAUSES) == set(FIXES)
