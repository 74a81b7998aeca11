"""Per-layer summary: ``fusionguard.summary()`` and ``fusionguard.export(path)``, and the one
shape of the log's ``summary`` event (``log_summary``), whoever writes it.

Underscored because the module is not the API: its public names are reached through the package
(``fusionguard.summary``, ``fusionguard.export``, ``fusionguard.Summary``, loaded on first use);
a module named ``summary``, once imported, would replace the function ``fusionguard.summary`` on
the package (importing a submodule sets it as an attribute of its package; ``watching`` says the same)."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Dict, List, Optional, Union

from fusionguard.core.state import STATE
from fusionguard.eventlog.distributed import gather_to_rank0
from fusionguard.eventlog.formatting import causes_text, count_text, mem_text, table
from fusionguard.eventlog.header import rank_info

COLUMNS = (
    "layer",
    "phase",
    "calls",
    "dense",
    "allowed",
    "fused",
    "recompute",
    "causes",
    "alloc_delta_last",
    "alloc_delta_max",
    "peak_delta_last",
    "peak_delta_max",
    "scores_bytes",
    "rank",
)


class Summary(list):
    """A list of per-(layer, phase) rows (dicts) that prints as a table: the same layout, units
    and cause style as ``fusionguard report`` (``fusionguard.eventlog.formatting``); the
    ``allowed`` column (dense on purpose, never counted as dense) only when a row has one, as there."""

    def __str__(self) -> str:
        if not self:
            return "fusionguard: no FlexAttention layer seen (is the model inside fusionguard.watch(model)?)"
        allowed = any(r.get("allowed") for r in self)
        rows = [
            [
                str(r["layer"]),
                str(r["phase"]),
                count_text(r.get("calls")),
                count_text(r.get("dense")),
                *([count_text(r.get("allowed"))] if allowed else []),
                count_text(r.get("fused")),
                causes_text(r.get("causes")),
                mem_text(r.get("alloc_delta_last"), r.get("alloc_delta_max")),
                mem_text(r.get("peak_delta_last"), r.get("peak_delta_max")),
            ]
            for r in self
        ]
        heads = ["layer", "phase", "calls", "dense", *(["allowed"] if allowed else []), "fused", "causes"]
        heads += ["alloc Δ last / max", "peak Δ last / max"]
        return "\n".join(table(heads, rows, right=(2, 3, 4, 5) if allowed else (2, 3, 4)))


def summary(all_ranks: bool = False) -> Summary:
    """Per layer and phase: calls, dense, allowed (``allow_dense()``: not dense) and fused calls,
    causes seen, allocated and peak deltas (last, max) in bytes. Also written to the log. ``all_ranks=True`` gathers every rank's rows to
    rank 0 through torch.distributed (other ranks get their own rows)."""
    if not isinstance(all_ranks, bool):
        raise TypeError(f"fusionguard.summary(): all_ranks must be True or False, not {all_ranks!r}")
    rows = own_rows()
    rank = rows[0]["rank"] if rows else _rank()
    if all_ranks:
        try:
            gathered = gather_to_rank0(rows)
            if gathered is not None and rank == 0:
                rows = [r for part in gathered for r in (part or [])]
        except ImportError:
            pass
    log_summary(rows, all_ranks)
    return Summary(rows)


def _rank() -> Any:
    try:
        return rank_info()["rank"]
    except Exception:
        return 0


def own_rows() -> List[Dict[str, Any]]:
    """This process's rows (``STATE.stats``), each with its ``rank``."""
    rows = STATE.stats.summary()
    rank = _rank()
    for r in rows:
        r["rank"] = rank
    return rows


def log_summary(rows: Optional[List[Dict[str, Any]]] = None, all_ranks: bool = False) -> None:
    """Write the ``summary`` event, in its one shape, for ``summary()`` and for the end of a log
    (``disable()``, exit, a new ``log_path``): ``rows`` (per layer and phase, each with its
    ``rank``; default: this process's), ``all_ranks`` (True: every rank's rows, gathered to rank
    0) and ``counts`` (this process's counters)."""
    if rows is None:
        rows = own_rows()
    STATE.log.emit("info", "summary", rows=rows, all_ranks=all_ranks, counts=dict(STATE.counts))


def export(path: Union[str, "os.PathLike[str]"]) -> str:
    """Write ``summary()`` as JSON or CSV, chosen by the file extension. Returns the path."""
    path = os.fspath(path)
    rows = summary()
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        with open(path, "w") as fh:
            json.dump({"rows": list(rows)}, fh, indent=1, default=str)
    elif ext == ".csv":
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(COLUMNS), extrasaction="ignore")
            writer.writeheader()
            for r in rows:
                r = dict(r)
                r["causes"] = ";".join(f"{k}={v}" for k, v in (r.get("causes") or {}).items())
                writer.writerow(r)
    else:
        raise ValueError(f"fusionguard.export: unknown extension {ext!r} (use .json or .csv)")
    return path
