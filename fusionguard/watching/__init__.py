"""Layer attribution and per-layer memory: ``fusionguard.watch(model)``.

Why this design:
- The current layer lives in a ``ContextVar`` (a tuple of qualified names): threads and asyncio
  tasks each see their own, there is no global stack to corrupt. Forward pre-/post-hooks push and
  pop it; post-hooks use ``always_call=True`` so a layer that raises still pops.
- A backward carries its forward's layer on the autograd ``ctx`` (see ``dense.guard``), so interleaved
  and checkpointed backward get the right name; a forward that runs *inside* a backward (activation
  checkpointing recompute) is flagged ``recompute`` and not counted as a new forward call.
- Memory comes from the CUDA caching allocator's own counters. A layer's *peak* can only be read
  by resetting the peak counter when the layer starts (``torch.cuda.reset_peak_memory_stats``);
  nested layers fold their peaks into the enclosing ones, and ``fusionguard.peak_memory_allocated()``
  keeps the true process peak, since ``torch.cuda.max_memory_allocated()`` then only reports the
  peak since the last watched layer (announced once, see README). ``watch(model, memory=False)``
  never touches the counters.
- Only *attention layers* are measured: modules whose class has been seen making a FlexAttention
  call (or the classes / names passed as ``layers=``). Everything else costs one ContextVar set.
- Modules inside a ``torch.compile``d module get no hooks (Dynamo would trace them and recompile);
  their fused calls are attributed at compile time from the FX node's ``nn_module_stack``, dense
  ones by the module whose forward is on the stack (``naming.layer_from_stack``). Hooks on modules
  fusionguard could not know are compiled (a compiled function calling the model, watch() before
  torch.compile) are out of Dynamo's sight while it compiles (``hooks.out_of_sight``): the
  compile is the one without watch(). Those it must trace (a module with hooks of its own) are
  the same function objects at every watch() entry, so re-entering does not recompile.

Modules: ``naming`` (names, layer lookup, backward spans), ``paths`` (names without watch(): the
model's own paths), ``memory`` (CUDA peaks, per-layer rows), ``hooks`` (the hook pool), ``watcher``
(``Watch``, ``watch()``). Named ``watching`` and ``watcher``,
never ``watch``: importing a submodule sets it as an attribute of its package, and both
``fusionguard.watch`` and ``fusionguard.watching.watch`` must stay the function.
"""

from fusionguard.watching.memory import peak_memory_allocated
from fusionguard.watching.watcher import Watch, watch

__all__ = ["Watch", "peak_memory_allocated", "watch"]
