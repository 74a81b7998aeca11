"""fusionguard's work per compiled-graph run on the fused path, in microseconds: one tiny
compiled FlexAttention graph (Inductor, fused), called with fusionguard's enabled flag set and
cleared on alternate calls (order alternating within pairs); median of the per-pair differences.
The graph is compiled with fusionguard on, so it carries the per-run counting that is timed.

``--cases`` adds the runs of one ``torch.compile(flex_attention)`` called from an eager module's
forward (Hugging Face's way), each under ``--depth`` extra Python frames (a training script's):
``plain`` (no watch), ``watched`` (the caller is a layer of a watched model: its hooks name the
calls; the hooks' own work is in the difference), ``teacher`` (the caller is an unwatched model
of another architecture while a model is watched), ``hookless`` (the caller is a layer of a model
tracked with ``hooks=False``: named by its watched forward, found on the stack),
``hookless-reference`` (an unwatched copy of that model calls, while that session runs) and
``hookless-teacher`` (the unwatched model of another architecture calls, while that session runs).

    python benchmarks/fused_run_cost.py [--device cpu|cuda] [--pairs 3000]
    python benchmarks/fused_run_cost.py --device cpu --cases --depth 30 --pairs 2000
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable

import torch
from paired import paired
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard.core.state import STATE


class Attn(torch.nn.Module):
    flex: Any = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return type(self).flex(q, k, v)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn(q, k, v)


class Teacher(Model):
    """Another architecture (its own classes): a teacher or reference model nobody watches."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.attn = TeacherAttn()


class TeacherAttn(Attn):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return type(self).flex(q, k, v)


def deep(depth: int, call: Callable[[], Any]) -> Any:
    """``call`` under ``depth`` more Python frames."""
    return call() if depth <= 0 else deep(depth - 1, call)


def cases(args: argparse.Namespace, sync: Callable[[], Any]) -> None:
    q = torch.randn(1, 2, 32, 16, device=args.device)
    k, v = torch.randn_like(q), torch.randn_like(q)
    Attn.flex = torch.compile(flex_attention)
    student, reference, teacher = Model(), Model(), Teacher()
    variants = {
        "plain": (contextlib.nullcontext, teacher),
        "watched": (lambda: fusionguard.watch(student, expect_flex=False), student),
        "teacher": (lambda: fusionguard.watch(student, expect_flex=False), teacher),
        "hookless": (lambda: fusionguard.track(student, hooks=False), student),
        "hookless-reference": (lambda: fusionguard.track(student, hooks=False), reference),
        "hookless-teacher": (lambda: fusionguard.track(student, hooks=False), teacher),
    }
    with torch.no_grad():
        for name, (context, caller) in variants.items():
            with context():
                for _ in range(20):
                    caller(q, k, v)
                before = STATE.counts.get("fused_runs_forward", 0)
                diff, plain = paired(lambda: deep(args.depth, lambda: caller(q, k, v)), args.pairs, sync)
                counted = STATE.counts.get("fused_runs_forward", 0) - before
            assert counted == args.pairs, f"{name}: fusionguard counted {counted} fused runs, expected {args.pairs}"
            print(f"  {name:18s} call {plain * 1e6:7.1f} us unguarded; fusionguard {diff * 1e6:+6.2f} us per run")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pairs", type=int, default=3000)
    ap.add_argument("--cases", action="store_true", help="a compiled flex_attention called from watched / unwatched modules")
    ap.add_argument("--depth", type=int, default=30, help="extra Python frames above each call (--cases)")
    args = ap.parse_args()
    fusionguard.enable(log_path=False)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    if args.cases:
        print(f"{args.device}, torch {torch.__version__}, {args.depth} extra frames, median of {args.pairs} pairs:")
        cases(args, sync)
        fusionguard.disable()
        return
    q = torch.randn(1, 2, 32, 16, device=args.device)
    k, v = torch.randn_like(q), torch.randn_like(q)
    fn = torch.compile(flex_attention)
    with torch.no_grad():
        for _ in range(20):
            fn(q, k, v)
        before = STATE.counts.get("fused_runs_forward", 0)
        diff, plain = paired(lambda: fn(q, k, v), args.pairs, sync)
    counted = STATE.counts.get("fused_runs_forward", 0) - before
    fusionguard.disable()
    assert counted == args.pairs, f"fusionguard counted {counted} fused runs, expected {args.pairs}"
    print(
        f"{args.device}, torch {torch.__version__}: graph run {plain * 1e6:.1f} us unguarded; "
        f"fusionguard per run {diff * 1e6:+.2f} us (median of {args.pairs} pairs; {counted} runs counted)"
    )


if __name__ == "__main__":
    main()
