"""One registry of reversible patches: originals saved once, restored exactly.

Originals are read from the owning ``dict`` (``vars(cls)``, a module's ``__dict__``, a dispatch
table), never through ``getattr``, so a staticmethod or a bound method comes back as the very same
object. ``apply`` is idempotent: a key already patched is left alone (never double-wrapped).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, MutableMapping, Optional

_MISSING = object()


@dataclass
class Patch:
    name: str
    table: MutableMapping  # the dict that holds the original (vars(cls) proxy is set via setattr)
    key: Any
    original: Any
    replacement: Any
    owner: Any = None  # for class attributes: the class (mappingproxy is read-only)
    after: Optional[Callable[[], None]] = None  # e.g. clear a dispatch cache

    def _set(self, value: Any) -> None:
        if self.owner is not None:
            setattr(self.owner, self.key, value)
        else:
            self.table[self.key] = value
        if self.after is not None:
            self.after()

    def install(self) -> None:
        self._set(self.replacement)

    def remove(self) -> None:
        current = self.table.get(self.key, _MISSING)
        if current is self.replacement:
            self._set(self.original)


class PatchRegistry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._patches: Dict[str, Patch] = {}

    def apply(
        self,
        name: str,
        table: MutableMapping,
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

    def remove_all(self) -> None:
        with self._lock:
            for patch in reversed(list(self._patches.values())):
                patch.remove()
            self._patches.clear()

    def names(self) -> list:
        with self._lock:
            return list(self._patches)

    def originals(self) -> Dict[str, Any]:
        with self._lock:
            return {name: p.original for name, p in self._patches.items()}
