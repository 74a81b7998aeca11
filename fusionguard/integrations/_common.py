"""What every framework callback shares: enable and watch once, counts since the callback
started, the first-step verdict, the summary at the end. No framework is imported here."""

from __future__ import annotations

import atexit
import logging
from typing import Any, Dict, List, Optional, Tuple

import fusionguard
from fusionguard.core.state import STATE, internal_error
from fusionguard._summary import Summary
from fusionguard.core.config import Config, check_log_path, check_options
from fusionguard.core.distributed import process_group_ready
from fusionguard.torch_internals import attn_implementation
from fusionguard.core.tables import NO_LAYER

# the metric names every integration reports (cumulative since the callback started)
DENSE, FUSED, PEAK = "fusionguard/dense_calls", "fusionguard/fused_calls", "fusionguard/peak_layer_bytes"
_DENSE_KEYS = ("dense_forward", "dense_backward")
_FUSED_KEYS = ("fused_runs_forward", "fused_runs_backward")


def missing(library: str, extra: str) -> ImportError:
    """The one-line error when the framework is not installed."""
    return ImportError(f"fusionguard.integrations.{extra} needs {library}: pip install 'fusionguard[{extra}]'")


def unwrap(model: Any) -> Any:
    """The model under DataParallel / DistributedDataParallel / FSDP1 wrappers (their ``module``);
    a ``torch.compile`` wrapper is kept: ``watch()`` names through it and hooks nothing inside."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    wrappers: Tuple[type, ...] = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel  # lazy: torch loads on first use, never when this module is imported

        wrappers += (FullyShardedDataParallel,)
    except Exception:
        pass
    for _ in range(8):
        inner = getattr(model, "module", None)
        if not (isinstance(model, wrappers) and isinstance(inner, torch.nn.Module)):
            break
        model = inner
    return model


class Session:
    """One callback's hold on fusionguard: ``start`` enables (unless the program already did:
    its settings stand) and watches the model; ``stop`` leaves the watch; the process's exit
    disables only what this session enabled."""

    def __init__(self, strict: bool, options: Dict[str, Any], owner: str = "FusionGuardCallback") -> None:
        rest = {k: v for k, v in options.items() if k != "log_path"}
        try:  # a bad option: enable()'s error, now (not at the Trainer's start), naming the callback
            check_options(rest)
            check_log_path(options.get("log_path"))
            Config(strict=strict, **rest)
        except (TypeError, ValueError) as exc:
            raise type(exc)(str(exc).replace("fusionguard.enable()", f"{owner}()")) from None
        self.strict = strict
        self.options = options
        self.enabled_here = False
        self.config: Any = None
        self.watch: Optional[Any] = None
        self.model: Any = None
        self.base: Dict[str, int] = {}  # counts when the callback started (the metrics)
        self.marked: Dict[str, int] = {}  # counts at the last mark() (the verdict)
        self.rows_base: Dict[Tuple[str, str], Tuple[int, int]] = {}  # at the last mark()
        self.rows_start: Dict[Tuple[str, str], Tuple[int, int]] = {}  # when the callback started

    def start(self, model: Any, hooks: bool = True) -> None:
        if not fusionguard.is_enabled():
            fusionguard.enable(strict=self.strict, **self.options)
            if fusionguard.is_enabled():  # (FUSIONGUARD=off: a no-op)
                if not self.enabled_here:
                    atexit.register(self._at_exit)
                self.enabled_here = True
                self.config = STATE.config
        if model is None or self.watch is not None:
            return
        try:
            import torch  # lazy: torch loads on first use, never when this module is imported

            inner = unwrap(model)
            if isinstance(inner, torch.nn.Module):
                from fusionguard.watching import Watch  # lazy: it imports torch

                self.watch = Watch(inner, hooks=hooks).__enter__()
                self.model = inner
        except Exception as exc:
            internal_error("integration watch", exc)
        self.base = dict(STATE.counts)
        self.mark()
        self.rows_start = dict(self.rows_base)

    def mark(self) -> None:
        """Counts and rows start from here (what ran before the framework's run is not its)."""
        self.marked = dict(STATE.counts)
        self.rows_base = {(r["layer"], r["phase"]): (r["dense"], r["fused"]) for r in STATE.stats.summary()}

    def stop(self) -> None:
        w, self.watch = self.watch, None
        if w is not None:
            try:
                w.__exit__(None, None, None)
            except Exception as exc:
                internal_error("integration watch exit", exc)

    def _at_exit(self) -> None:
        self.stop()
        # only the enable() this session made (not one a later owner made after a disable())
        if self.enabled_here and fusionguard.is_enabled() and STATE.config is self.config:
            fusionguard.disable()

    # numbers
    def _since(self, keys: Tuple[str, ...], base: Optional[Dict[str, int]] = None) -> int:
        counts, base = STATE.counts, self.base if base is None else base
        return sum(counts.get(k, 0) - base.get(k, 0) for k in keys)

    def metrics(self) -> Dict[str, float]:
        """Cumulative dense and fused FlexAttention calls since the callback started; the largest
        per-layer peak (bytes) where a watched layer was measured (CUDA)."""
        out: Dict[str, float] = {DENSE: float(self._since(_DENSE_KEYS)), FUSED: float(self._since(_FUSED_KEYS))}
        peaks = [r["peak_delta_max"] for r in STATE.stats.summary() if r.get("peak_delta_max") is not None]
        if self.watch is not None and peaks:
            out[PEAK] = float(max(peaks))
        return out

    def rows(self, since_start: bool = False) -> List[Dict[str, Any]]:
        """Per (layer, phase): dense and fused calls since ``mark()`` (or since the start)."""
        base = self.rows_start if since_start else self.rows_base
        out = []
        for r in STATE.stats.summary():
            d0, f0 = base.get((r["layer"], r["phase"]), (0, 0))
            dense, fused = r["dense"] - d0, r["fused"] - f0
            if dense or fused:
                causes = r.get("causes") if dense else {}
                out.append({**r, "dense": dense, "fused": fused, "calls": dense + fused, "causes": causes})
        return out

    def dense_seen(self, since_start: bool = False) -> bool:
        """Dense calls since the last ``mark()`` (or since the callback started)."""
        return self._since(_DENSE_KEYS, None if since_start else self.marked) > 0

    def verdict(self, label: str, model: Any = None) -> Tuple[str, bool]:
        """One line: ``fusionguard: step 1: 16 FlexAttention layers, forward fused 16/16, backward
        fused 16/16``; otherwise what ran dense and why, and what never ran flex. (text, all fused)."""
        try:
            return _verdict(label, self.rows(), self._since(_DENSE_KEYS, self.marked), model if model is not None else self.model)
        except Exception as exc:
            internal_error("integration verdict", exc)
            return f"fusionguard: {label}: no verdict (internal error, see the log)", True

    def summary_text(self) -> str:
        """The summary table of the calls since the callback started (``fusionguard.summary()``
        counts the whole process)."""

        return str(Summary(self.rows(since_start=True)))


def _verdict(label: str, rows: List[Dict[str, Any]], dense_total: int, model: Any) -> Tuple[str, bool]:
    rows = [r for r in rows if r["layer"] != NO_LAYER]  # (calls no layer reaches: in dense_total, not layers)
    layers = sorted({r["layer"] for r in rows})

    impl = attn_implementation(model)
    impl_text = f" (config._attn_implementation={impl!r})" if impl else ""
    if not layers:
        if dense_total:
            return f"fusionguard: {label}: {dense_total} dense FlexAttention call(s) outside any watched layer", False
        return f"fusionguard: {label}: no FlexAttention call: the model never ran flex{impl_text}", False
    parts = [f"fusionguard: {label}: {len(layers)} FlexAttention layer{'s' if len(layers) != 1 else ''}"]
    dense_rows = [r for r in rows if r["dense"]]
    for phase in ("forward", "backward"):
        ran = {r["layer"] for r in rows if r["phase"] == phase}
        if ran:
            clean = {r["layer"] for r in rows if r["phase"] == phase and not r["dense"]}
            parts.append(f"{phase} fused {len(clean)}/{len(layers)}")
    text = ", ".join(parts)
    ok = not dense_rows and dense_total == 0
    if dense_rows:
        text += "; dense: " + "; ".join(_dense_text(r) for r in dense_rows[:4])
        if len(dense_rows) > 4:
            text += f"; +{len(dense_rows) - 4} more"
    never = _never_ran(layers, model)
    if never:
        ok = False
        shown = ", ".join(never[:4]) + (f", +{len(never) - 4} more" if len(never) > 4 else "")
        text += f"; never ran flex: {shown}{impl_text}"
    return text, ok


def _dense_text(row: Dict[str, Any]) -> str:
    causes = ", ".join(sorted(row.get("causes") or {})) or "cause unknown"
    return f"{row['layer']} {row['phase']} x{row['dense']} ({causes})"


def _never_ran(layers: List[str], model: Any) -> List[str]:
    """Modules of the same classes as the layers that ran flex, which did not."""
    if model is None:
        return []
    try:
        from fusionguard.watching import clean_name  # lazy: it imports torch

        named = {clean_name(n): m for n, m in model.named_modules()}
        classes = {type(named[name]) for name in layers if name in named}
        return sorted(n for n, m in named.items() if type(m) in classes and n not in layers)
    except Exception as exc:
        internal_error("integration never-ran", exc)
        return []


def dense_ranks(dense: bool) -> List[int]:
    """The ranks whose run went dense, the same list on every rank (``stop_on_dense``). Under
    several processes a collective that every rank must call: a rank that stopped alone would
    leave the others waiting in their next collective (NCCL) or failing it (gloo). One small
    all-reduce; on failure, this rank's own answer."""

    if not process_group_ready():
        return [0] if dense else []
    try:
        import torch  # lazy: torch loads on first use, never when this module is imported
        import torch.distributed as dist  # lazy: torch loads on first use, never when this module is imported

        nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32,
                            device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
        flags[dist.get_rank()] = int(dense)
        dist.all_reduce(flags)
        return [r for r, flag in enumerate(flags.tolist()) if flag]
    except Exception as exc:
        internal_error("integration dense_ranks", exc)
        return [0] if dense else []


def stop_text(ranks: List[int], where: str) -> str:
    """``stop_on_dense``'s line on rank 0: which ranks ran dense (each rank's log names the layers)."""

    on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if process_group_ready() else ""
    return f"fusionguard: stop_on_dense: dense FlexAttention{on} at {where}: training stops"


def log_at(ok: bool) -> int:
    return logging.INFO if ok else logging.WARNING
