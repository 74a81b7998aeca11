"""Module names without ``watch()`` (``fusionguard run``, an integration that cannot reach the
root model): the path of a compiled frame's module from the outermost module holding it.

Why: Dynamo names modules relative to the frame it compiled. With ``block.compile()`` on each
block (torchtitan's pattern) that is the block, so every block's attention is ``attn``; a Hugging
Face model compiled whole runs its inner ``LlamaModel`` frame, so ``layers.0.self_attn`` where
``named_modules()`` says ``model.layers.0.self_attn``. Without ``watch(model)`` nothing says
which model holds the module, so it is looked up once: one ``gc.get_objects()`` pass finds every
live module's children (``_modules``), the module's parents are climbed to the outermost one
(through ``torch.compile`` / DDP / FSDP1 wrappers, which add no name, as under ``watch()``), and
that model's ``named_modules()`` names all its modules at once. Only at compile time and at the
first run of a module not named yet; a run then costs one dict lookup.

When the outermost module is not the only live one of its class (blocks held in a plain list,
two copies of a model), a path from it would merge different modules' calls into one row: the
name is then visibly partial, ``Block[1].attn`` (the class and the order in which its instances
were first named), and a one-time note says that ``watch(model)`` gives full names."""

from __future__ import annotations

import gc
import itertools
import sys
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from fusionguard import torch_internals as ti
from fusionguard.core.frames import is_torch_file
from fusionguard.core.state import STATE, guarded
from fusionguard.eventlog.messages import logger
from fusionguard.watching.naming import clean_name, wrapper_chain

# (a scan keeps at most this many modules' parents; a process past it gets partial names)
MAX_MODULES = 1_000_000
# per process: a program creating modules forever does not scan forever (its later modules get
# partial names, found without a scan)
MAX_SCANS = 16
MAX_SCAN_S = 2.0
MAX_NAMES = 200_000
# A scan walks every object the collector tracks (about 60 ns each): past this many live blocks
# (a dataset held as Python lists) one scan would stall the step for over a second: no scan,
# names partial instead
MAX_BLOCKS = 20_000_000


def _paths() -> Any:
    return STATE.caches.module_paths


def _alive(entry: Optional[Tuple[Any, ...]], module: Any) -> bool:
    """Whether a table's entry (a weak reference first) is still about ``module`` (ids are reused)."""
    return entry is not None and entry[0] is not None and entry[0]() is module


def _scan() -> None:
    """Every live module's parent, from one pass over the objects the collector tracks."""
    t0 = time.perf_counter()
    try:
        _scan_now()
    finally:
        _paths().scans += 1
        _paths().scan_s += time.perf_counter() - t0


def _scan_now() -> None:
    parents: Dict[int, Tuple[Any, Any, str]] = {}
    objects = gc.get_objects()
    try:  # (filtered by exact type in C: no object's own __class__ or __getattr__ runs)
        kinds = {t for t in set(map(type, objects)) if issubclass(t, torch.nn.Module)}
        modules: List[torch.nn.Module] = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))[:MAX_MODULES]
    finally:
        del objects
    for m in modules:
        children = m.__dict__.get(ti.MODULES) or {}
        for key, child in children.items():
            if child is not None and id(child) not in parents:
                parents[id(child)] = (weakref.ref(child), weakref.ref(m), key)
    _paths().parents = parents
    _paths().tops = {id(m): weakref.ref(m) for m in modules if id(m) not in parents}


def _parent(module: torch.nn.Module) -> Optional[Tuple[torch.nn.Module, str]]:
    entry = _paths().parents.get(id(module))
    if not _alive(entry, module):
        return None
    assert entry is not None
    parent = entry[1]()
    return (parent, entry[2]) if parent is not None else None


def _same_class_tops(top: torch.nn.Module) -> int:
    """How many outermost modules (unwrapped) of ``top``'s class the last scan found alive."""
    n = 0
    cls = type(top)
    for ref in _paths().tops.values():
        m = ref()
        if m is not None and type(wrapper_chain(m)[-1]) is cls:
            n += 1
    return n


def _another_rooted(top: torch.nn.Module) -> bool:
    """Another live model already has the root names (``layers.0.attn``): a second model, of
    any class (a policy and a reward model), is named partially, never into the same rows."""
    ref = _paths().rooted
    held = ref() if ref is not None else None
    return held is not None and held is not top


def _partial_root(top: torch.nn.Module) -> str:
    """``Class[i]``: ``top``'s class and the order in which its instances were named partially."""
    paths = _paths()
    cls = type(top).__name__
    i = paths.partial.get(cls, 0)
    paths.partial[cls] = i + 1
    root = f"{cls}[{i}]"
    _note_partial(root)
    return root


def _name_tree(chain: List[torch.nn.Module], partial: bool = False) -> None:
    """Name every module of ``top`` (the unwrapped outermost module, its wrappers ``chain``): its
    own paths, or under a partial root ``Class[i]`` when other live modules of its class are
    outermost too, or ``partial`` (a module added to a model named before keeps that model's
    root)."""
    paths = _paths()
    if len(paths.names) > MAX_NAMES:  # (models made and dropped all along: forget the dead)
        paths.names = {k: e for k, e in paths.names.items() if e[0]() is not None}
    top = chain[-1]
    known = paths.names.get(id(top))
    if _alive(known, top):
        root = known[1]
    elif partial or _same_class_tops(top) > 1 or _another_rooted(top):
        root = _partial_root(top)
    else:
        root = ""
        paths.rooted = weakref.ref(top)
    for m in chain[:-1]:
        paths.names[id(m)] = (weakref.ref(m), root)
    for name, m in top.named_modules():
        if not _alive(paths.names.get(id(m)), m):
            full = ".".join(x for x in (root, clean_name(name)) if x)
            paths.names[id(m)] = (weakref.ref(m), full)


def _note_partial(example: str) -> None:
    if _paths().noted:
        return
    _paths().noted = True
    text = (
        f"fusionguard: layer names such as '{example}.…' are partial: no single model holding these "
        "modules was found; fusionguard.watch(model) gives full names"
    )
    logger.info(text)
    STATE.log.emit("info", "partial_names", example=example, fix="fusionguard.watch(model)")


def module_path(module: Any) -> Optional[str]:
    """The name of ``module`` from the outermost module holding it ('' for that module itself,
    ``Class[i]...`` when partial); None when it cannot be found (a lookup error)."""
    if not isinstance(module, torch.nn.Module):
        return None
    entry = _paths().names.get(id(module))
    if _alive(entry, module):
        assert entry is not None
        return entry[1]
    with guarded("module path"):
        return _find(module)
    return None


def _find(module: torch.nn.Module) -> Optional[str]:
    paths = _paths()
    if not _alive(paths.parents.get(id(module)), module) and not _alive((paths.tops.get(id(module)),), module):
        if paths.scans >= MAX_SCANS or paths.scan_s >= MAX_SCAN_S or sys.getallocatedblocks() > MAX_BLOCKS:
            # no more scans: the module alone, partially named, still apart from the others
            _name_tree([module], partial=True)
            entry = paths.names.get(id(module))
            return entry[1] if _alive(entry, module) else None
        _scan()
    top, seen = module, {id(module)}
    while len(seen) < 256:
        up = _parent(top)
        if up is None or id(up[0]) in seen:
            break
        top = up[0]
        seen.add(id(top))
    _name_tree(wrapper_chain(top))
    entry = paths.names.get(id(module))
    return entry[1] if _alive(entry, module) else None  # (None: only in a wrapper's own path)


def is_module_forward(f: Any) -> bool:
    """A frame running the ``forward`` of one of the user's modules (not torch's own, e.g. the
    ``GraphModule`` an ``aot_eager`` graph runs in, generated code: ``<eval_with_key>``). Its ``self`` is read only then: before
    Python 3.13 reading a frame's locals leaves a snapshot on it until it returns."""
    c = f.f_code
    if c.co_name != "forward" or "self" not in c.co_varnames or c.co_filename.startswith("<") or is_torch_file(c.co_filename):
        return False
    return isinstance(f.f_locals.get("self"), torch.nn.Module)


def caller_name(frame: Any, limit: int = 60) -> Optional[str]:
    """Without ``watch()``: the name of the module whose ``forward`` (innermost) is on the stack
    from ``frame``: the layer of a dense call, or of a compiled function's one call (Hugging
    Face's compiled ``flex_attention``, called from each attention layer). None for the
    outermost module itself (a model is not a layer, as under ``watch()``)."""
    f = frame
    while f is not None and limit > 0:
        if is_module_forward(f):
            return module_path(f.f_locals.get("self")) or None
        f, limit = f.f_back, limit - 1
    return None
