"""One registry of everything fusionguard installs, each entry with its undo.

Two kinds of entries: a ``Patch`` replaces one slot of a dict (a class attribute, a module global
such as ``sys.excepthook``, a dispatch table entry, a compiled graph's ``current_callable``); a
``Hook`` is anything else that has an undo of its own (a signal handler, a logging handler, a
Dynamo callback). ``disable()`` removes them all, newest first; removing twice is a no-op.

Originals are read from the owning ``dict`` (``vars(cls)``, a module's ``__dict__``, a dispatch
table), never through ``getattr``, so a staticmethod or a bound method comes back as the very same
object; the replacement (a ``wrapt.FunctionWrapper`` at attribute sites, wrapping that very
object: ``patch_sites``) is what is put in the slot, and identity decides whether it is still
ours to take out. ``apply`` is idempotent: a key already patched is left alone (never
double-wrapped).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, MutableMapping, Optional, Union, cast

_MISSING = object()


@dataclass
class Patch:
    name: str
    table: Mapping[Any, Any]  # the dict that holds the original (a read-only vars(cls) is set via owner)
    key: Any
    original: Any
    replacement: Any
    owner: Any = None  # for class attributes: the class (mappingproxy is read-only)
    after: Optional[Callable[[], None]] = None  # e.g. clear a dispatch cache

    def _set(self, value: Any) -> None:
        if self.owner is not None:
            setattr(self.owner, self.key, value)
        else:
            cast(MutableMapping[Any, Any], self.table)[self.key] = value
        if self.after is not None:
            self.after()

    def install(self) -> None:
        self._set(self.replacement)

    def remove(self) -> None:
        current = self.table.get(self.key, _MISSING)
        if current is self.replacement:
            self._set(self.original)

    def restored(self) -> bool:
        """The original is back in its slot (identity)."""
        return self.table.get(self.key, _MISSING) is self.original


@dataclass
class Hook:
    """An installed thing that is undone by a call, not by putting a slot back."""

    name: str
    undo: Callable[[], None]
    restored: Callable[[], bool]  # True once the host's state is as before (identity where there is one)
    removed: bool = False

    def remove(self) -> None:
        if not self.removed:
            self.removed = True
            self.undo()


Entry = Union[Patch, Hook]


class PatchRegistry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._patches: Dict[str, Entry] = {}

    def after_fork_in_child(self) -> None:
        """The lock is free in a forked child (the thread holding it in the parent is not there)."""
        self._lock = threading.RLock()

    def apply(
        self,
        name: str,
        table: Mapping[Any, Any],
        key: Any,
        make: Callable[[Any], Any],
        owner: Any = None,
        after: Optional[Callable[[], None]] = None,
    ) -> bool:
        """Replace ``table[key]`` by ``make(original)``. False if already patched."""
        with self._lock:
            if name in self._patches:
                return False
            original = table[key]
            patch = Patch(name, table, key, original, make(original), owner, after)
            patch.install()
            self._patches[name] = patch
            return True

    def add_hook(self, name: str, undo: Callable[[], None], restored: Callable[[], bool]) -> bool:
        """Record something already installed and the call that undoes it. False if ``name`` is known."""
        with self._lock:
            if name in self._patches:
                return False
            self._patches[name] = Hook(name, undo, restored)
            return True

    def remove(self, name: str) -> None:
        """Undo one entry; unknown or already removed: nothing happens."""
        with self._lock:
            entry = self._patches.pop(name, None)
            if entry is not None:
                entry.remove()

    def remove_all(self) -> None:
        with self._lock:
            for entry in reversed(list(self._patches.values())):
                entry.remove()
            self._patches.clear()

    def names(self) -> List[str]:
        """The slots patched (``Patch`` entries): what the log header lists as guarded."""
        with self._lock:
            return [n for n, e in self._patches.items() if isinstance(e, Patch)]

    def entries(self) -> List[Entry]:
        """Every entry, patches and hooks, oldest first."""
        with self._lock:
            return list(self._patches.values())
