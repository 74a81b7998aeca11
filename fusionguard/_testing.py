"""Hooks for fusionguard's own tests and benchmarks, never for programs: nothing in the package
calls them. They live here, not in the modules they reach into, so that production code holds
none of them (issue #33)."""

from __future__ import annotations

import dataclasses

from fusionguard import torch_internals as ti
from fusionguard.core.state import STATE
from fusionguard.watching import hooks


def crash_hooks_installed() -> bool:
    """Tests: the crash hooks (excepthooks, SIGTERM, faulthandler file) are in place."""
    return STATE.crash.active


def reset_for_tests() -> None:
    """Tests: forget everything (patches must already be removed), the sessions' said-once lines too."""
    STATE.reset()


def set_guarding(on: bool) -> None:
    """Benchmarks: switch every installed wrapper to a pass-through (False) and back, patches left
    in place: the paired on/off timing of one and the same installed graph. The running settings
    stay; only their ``enabled`` changes (what every wrapper reads first)."""
    STATE.runtime.now = dataclasses.replace(STATE.runtime.now, enabled=on)


def keep_out_of_sight(on: bool) -> None:
    """Benchmarks: hide watch()'s hooks from Dynamo (the default) or leave them traced, as before
    #24 (``benchmarks/watch_compile_cost.py``'s ``traced`` variant)."""
    sight = hooks._SIGHT
    sight.on = on
    if sight.codes:
        ti.skip_frames(sight.codes, on)
