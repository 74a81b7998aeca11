"""PyTorch's module paths and the registry of every private PyTorch name fusionguard spells
(``PRIVATE_NAMES``), with the constants the rest of the package uses instead of the names."""

from __future__ import annotations

import re
from typing import Dict

HOP_MODULE = "torch._higher_order_ops.flex_attention"
PUBLIC_MODULE = "torch.nn.attention.flex_attention"
LOWERING_MODULE = "torch._inductor.lowering"
FLEX_LOWERING_MODULES = ("torch._inductor.kernel.flex.flex_attention", "torch._inductor.kernel.flex_attention")
OUTPUT_CODE_MODULES = ("torch._inductor.output_code", "torch._inductor.codecache")
DYNAMO_UTILS = "torch._dynamo.utils"

# Functions inside the Inductor flex lowering module that choose a non-default template.
# Looked up by name; any that a version lacks is simply not observed.
TEMPLATE_SELECTORS = {
    "lower_cpu": "cpp",
    "create_flex_decoding_kernel": "triton_decode",
    "create_flex_flash_attention_kernel": "flash",
    "create_flex_flash_attention_backward_kernel": "flash",
    "lower_mps": "mps",
}


# --- The registry of PyTorch's private names -------------------------------------------------

#: name -> whose it is and why fusionguard spells it: every underscore-prefixed one, and the
#: non-underscore internals (no public API) the rest of the package needs. tests/test_wiring.py
#: catches a new underscore name anywhere else; a new non-underscore internal only once it is
#: registered here: register it when you first use it.
PRIVATE_NAMES: Dict[str, str] = {}


def _private(name: str, why: str) -> str:
    """Register one of PyTorch's private names (``why``: the object it belongs to, what for)."""
    PRIVATE_NAMES[name] = why
    return name


# torch's own modules, reached as attributes
TORCH_C = _private("_C", "torch._C: the C extension module")
DYNAMO = _private("_dynamo", "torch._dynamo: Dynamo, reached as an attribute of torch")
FUNCTORCH_C = _private("_functorch", "torch._C._functorch: functorch's C functions (is a tensor a vmap/grad wrapper)")
IS_FUNCTIONAL_TENSOR = _private("_is_functional_tensor", "torch._is_functional_tensor / torch._C's: a functionalization wrapper")
GRAPH_TASK_ID = _private("_current_graph_task_id", "torch._C: the id of the backward pass running on this thread")
PROFILER_FLAG = _private("_is_profiler_enabled", "torch.autograd.profiler: the flag torch.profiler sets")
PROFILER_ENABLED = _private("_profiler_enabled", "torch._C._autograd: the C function behind that flag")
# the FlexAttention operators and their dense kernels
PY_KERNELS = _private("py_kernels", "HigherOrderOperator: its Python kernels by dispatch key (the dense kernel's seam)")
DISPATCH_CACHE = _private("_dispatch_cache", "HigherOrderOperator: the kernel resolved per dispatch key")
DENSE_FORWARD = _private("sdpa_dense", "torch._higher_order_ops.flex_attention: the dense forward kernel")
DENSE_BACKWARD = _private("sdpa_dense_backward", "torch._higher_order_ops.flex_attention: the dense backward kernel")
MATH_ATTENTION = _private("math_attention", "torch._higher_order_ops.flex_attention: the dense forward's arithmetic")
MATH_ATTENTION_INNER = _private("_math_attention_inner", "torch._higher_order_ops.flex_attention: inside math_attention")
FLEX_HOP_WRAPPER = _private("_flex_attention_hop_wrapper", "torch.nn.attention.flex_attention: the wrapper its internal compile compiles")
DEBUG_FLAG = _private("_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", "torch.nn.attention.flex_attention: run flex eagerly to debug (2.9+)")
DEFAULT_BLOCK_SIZE = _private("_DEFAULT_SPARSE_BLOCK_SIZE", "torch.nn.attention.flex_attention: the block size of create_block_mask")
IDENTITY_SCORE_MOD = _private("_identity", "torch.nn.attention.flex_attention: the no-op score_mod flex_attention defaults to")
MASK_COMPILE_FLAG = _private("_compile", "create_block_mask's parameter that compiled the build (deprecated from 2.13)")
SETUP_COMPILATION_ENV = _private(
    "setup_compilation_env", "torch.nn.attention.flex_attention: yields the backend of its eager compile (2.11+)"
)
# Inductor's compiled graphs
POST_COMPILE = _private("post_compile", "CompiledFxGraph: runs after every Inductor compile and cache hit (patched)")
CURRENT_CALLABLE = _private("current_callable", "CompiledFxGraph: the callable every run of the graph goes through (wrapped)")
POST_GRAD_GRAPH_STR = _private("inductor_post_grad_graph_str", "CompiledFxGraph: the post-grad FX graph's text (2.7+)")
RUNNABLE_GRAPH_STR = _private("runnable_graph_str", "CompiledFxGraph: the runnable FX graph's text")
COMPILE_TIMES = _private("compilation_time_metrics", "torch._dynamo.utils: seconds per compile step (Inductor's compile_fx_inner)")
INDUCTOR_COMPILE = "compile_fx_inner"  # (its key there: Inductor compiled, or loaded from its FX graph cache, a graph)
DYNAMO_COUNTERS = "counters"  # torch._dynamo.utils: Dynamo's, AOTAutograd's and Inductor's event counts
AUTOGRAD_CACHE_HIT = ("aot_autograd", "autograd_cache_hit")  # (a graph loaded from AOTAutograd's cache: no compile_fx_inner)
SOURCE_CODE = _private("source_code", "CompiledFxGraph: the generated module's Python source")
FWD_NN_MODULE_STACK = _private("fwd_nn_module_stack", "an FX node's meta: the forward's module stack, on a backward node")
START_CALLBACKS = _private("start_callbacks", "torch._dynamo.callback's handler: the compile-start callbacks")
END_CALLBACKS = _private("end_callbacks", "torch._dynamo.callback's handler: the compile-end callbacks")
REGISTER_START_CALLBACK = _private("register_start_callback", "torch._dynamo.callback's handler: add a compile-start callback")
REGISTER_END_CALLBACK = _private("register_end_callback", "torch._dynamo.callback's handler: add a compile-end callback")
REMOVE_END_CALLBACK = _private("remove_end_callback", "torch._dynamo.callback's handler: drop a compile-end callback")
CALLBACK_TRIGGER = _private(
    "callback_trigger", "torch._dynamo.callback's CallbackArgs: what started the compile (DYNAMO, a lazy backward, a CUDA graph)"
)
CUDAGRAPH_INFO = _private("cudagraph_info", "CompiledFxGraph: set when the graph runs as CUDA graphs")
FX_GRAPH_CACHE_KEY = _private("_fx_graph_cache_key", "CompiledFxGraph: the FX graph cache key on older releases (cache_key later)")
# Dynamo
ORIG_MOD = _private("_orig_mod", "OptimizedModule (torch.compile(module)): the compiled module")
ORIG_CALLABLE = _private("_torchdynamo_orig_callable", "OptimizedModule / Dynamo's frame callback: what it wraps")
ORIG_BACKEND = _private("_torchdynamo_orig_backend", "Dynamo's frame callback: the backend it wraps (2.8+)")
ONE_GRAPH = _private("_one_graph", "ConvertFrameAssert: compiles with fullgraph=True")
STANCE = _private("_stance", "torch._dynamo.eval_frame: torch.compiler.set_stance's stance")
CACHE_ENTRY_LIST = _private("_debug_get_cache_entry_list", "torch._dynamo.eval_frame: a code object's cache entries")
COMPILATION_METRICS = _private("_compilation_metrics", "torch._dynamo.utils: the per-frame compilation metrics")
CALL_FUNCTION = _private("_call_function", "FlexAttentionHigherOrderVariable: puts a flex call into a graph")
DISABLE_CONTEXT = _private("DisableContext", "torch._dynamo.eval_frame: the class of torch.compiler.disable's wrapper")
EVAL_FRAME_FILE = _private("eval_frame.py", "torch._dynamo.eval_frame's file: where the compile and disable wrappers run")
WRAPPER_FN = _private("_fn", "torch._dynamo.eval_frame: the function of the compile and disable wrappers")
COMPILE_WRAPPER_FN = _private("compile_wrapper", "torch._dynamo.eval_frame: the function of the torch.compile wrapper (newer releases)")
IS_TORCH_HANDLER = _private("_is_torch_handler", "torch._logging._internal: a handler torch._logging added")
# torch.fx
FX_CODE_FILE = _private("<eval_with_key>", "torch.fx.graph_module: how the file name of a GraphModule's generated code begins")
# AOTAutograd
AOT_RUNTIME_DIR = _private("_aot_autograd", "torch._functorch._aot_autograd: the directory of AOTAutograd's runtime")
BACKWARD_IMPL = _private("_backward_impl", "AOTAutograd's runtime wrappers: runs the compiled backward")
FWD_FN = _private("_fwd_fn", "AOTAutograd's runtime wrappers (some releases): the forward")
BWD_FN = _private("_bwd_fn", "AOTAutograd's runtime wrappers (some releases): the backward")
CALL_COMPILED_BACKWARD = _private("call_compiled_backward", "AOTAutograd's runtime wrappers (some releases): runs a compiled backward")
# autograd
ENGINE_RUN_BACKWARD = _private("_engine_run_backward", "torch.autograd.graph: the frame of every backward pass")
# nn.Module and its hooks
MODULES = _private("_modules", "nn.Module: its children, in its __dict__")
FORWARD_PRE_HOOKS = _private("_forward_pre_hooks", "nn.Module: its forward pre-hook dict, in its __dict__")
#: nn.Module's forward hook dicts (in its __dict__), each with the dicts of its hooks' flags, keyed by the same hook ids.
FORWARD_HOOK_DICTS = (
    (FORWARD_PRE_HOOKS, (_private("_forward_pre_hooks_with_kwargs", "nn.Module: the ids of its pre-hooks that take kwargs"),)),
    (
        _private("_forward_hooks", "nn.Module: its forward hook dict, in its __dict__"),
        (
            _private("_forward_hooks_with_kwargs", "nn.Module: the ids of its forward hooks that take kwargs"),
            _private("_forward_hooks_always_called", "nn.Module: the ids of its forward hooks called on an exception too"),
        ),
    ),
)
COMPILED_CALL_IMPL = _private("_compiled_call_impl", "nn.Module: set by module.compile()")
HOOKS_DICT_REF = _private("hooks_dict_ref", "RemovableHandle: a weak reference to the dict holding the hook")
EXTRA_DICT_REF = _private("extra_dict_ref", "RemovableHandle: weak references to the dicts of the hook's flags (with_kwargs, always_call)")
# context parallelism for FlexAttention (torchtitan's path: the public context_parallel() patches SDPA only)
CP_MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",  # 2.11 and 2.13 (checked)
    "torch.distributed.tensor.experimental._attention",  # earlier releases, and a re-export stub later
)
CONTEXT_PARALLEL = _private("_ContextParallel", "torch.distributed.tensor.experimental: ParallelStyle; AttentionType.FLEX all-gathers K/V")
CP_BLOCK_MASK = _private("_create_cp_block_mask", "torch.distributed.tensor.experimental: a rank's BlockMask, local Q against the whole KV")
CP_SHARD = _private(
    "_context_parallel_shard", "torch.distributed.tensor.experimental: shards buffers along the sequence as the mask expects"
)
FSDP_WRAPPED_MODULE = _private("_fsdp_wrapped_module", "FullyShardedDataParallel (FSDP1): the wrapped module")
CHECKPOINT_WRAPPED_MODULE = _private("_checkpoint_wrapped_module", "CheckpointWrapper (activation checkpointing): the wrapped module")

#: The attributes through which wrappers hold the wrapped module: DDP (``module``, public),
#: torch.compile, FSDP1, activation checkpointing.
WRAPPER_ATTRS = frozenset({"module", ORIG_MOD, FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE})
#: ``_orig_mod`` as one part of a dotted module name (``_orig_mod.layers.0``).
ORIG_MOD_PART = re.compile(rf"(^|\.){ORIG_MOD}(?=\.|$)")
#: Functions of the FlexAttention dense implementation (frames that mean "inside the dense kernel").
DENSE_FUNCTIONS = frozenset({DENSE_FORWARD, DENSE_BACKWARD, MATH_ATTENTION, MATH_ATTENTION_INNER})
#: The functions of AOTAutograd's runtime whose frames hold its autograd ``ctx``.
AOT_CTX_FUNCTIONS = ("forward", "backward", BACKWARD_IMPL, FWD_FN, BWD_FN, CALL_COMPILED_BACKWARD)


class Unavailable(LookupError):
    """This torch release lacks the feature (nothing failed): ``enable()`` names it in one line,
    ``not_patched`` records it and the tests skip by it."""


def torch_version() -> str:
    import torch  # lazy: torch loads on first use, never when this module is imported

    return str(torch.__version__).split("+")[0]
