"""Does a ``wrapt.FunctionWrapper`` at fusionguard's attribute patch sites change what
``torch.compile`` does? (#24; the answer is in docs/internals.md.)

No fusionguard wrappers: pass-through ones that count their calls, at every attribute site
``patch_sites`` patches (found through ``torch_internals``), or at none, or at one. A tiny
FlexAttention model (CPU inference) runs eager, then compiled with each backend
(``fullgraph=True``, ``dynamic=False``, a second shape: a recompile), plus a function that builds
its block mask inside the compiled region. Prints one JSON line: Dynamo's graph breaks and
unique graphs (summed over the backends), a digest of every output, the calls each wrapper saw
(0 under Dynamo: it inlines the original), the errors, and whether every original is back
(``is``). Compare the lines of ``none`` and ``all``:

    for m in none all; do TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/wrapt_sites.py $m; done
    python benchmarks/wrapt_sites.py all --backends aot_eager --device cuda   # on a GPU: + forward/backward
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import wrapt  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from fusionguard import torch_internals as ti  # noqa: E402

CALLS: Dict[str, int] = {}
STATS: Dict[str, Any] = {"graph_breaks": 0, "unique_graphs": 0, "break_reasons": []}


def sites() -> List[Tuple[str, Any, Dict[str, Any], str]]:
    """(name, owner for setattr or None, the dict holding the original, key)."""
    found: List[Tuple[str, Any, Dict[str, Any], str]] = []
    cls = ti.autograd_op()
    found += [(f"FlexAttentionAutogradOp.{k}", cls, vars(cls), k) for k in ("forward", "backward")]  # type: ignore[misc]
    cfg = ti.compiled_fx_graph()
    found.append(("CompiledFxGraph.post_compile", cfg, vars(cfg), "post_compile"))  # type: ignore[arg-type]
    var, name = ti.flex_trace_method()
    found.append((f"FlexAttentionHigherOrderVariable.{name}", var, vars(var), name))  # type: ignore[arg-type]
    om = ti.optimized_module()
    found.append(("OptimizedModule.__init__", om, vars(om), "__init__"))  # type: ignore[arg-type]
    mod = ti.flex_lowering_module()
    found += [(f"selector {n}", None, mod.__dict__, n) for n in ti.TEMPLATE_SELECTORS if callable(mod.__dict__.get(n))]
    for label, home in (("setup_compilation_env", ti.setup_compilation_env_home), ("create_mask", ti.mask_home)):
        try:
            found.append((label, None, home(), label))
        except Exception:  # this release lacks it
            pass
    return found


def _put(owner: Any, table: Dict[str, Any], key: str, value: Any) -> None:
    if owner is not None:
        setattr(owner, key, value)
    else:
        table[key] = value


def _counting(name: str) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        CALLS[name] = CALLS.get(name, 0) + 1
        return wrapped(*args, **kwargs)

    return wrapper


def causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q >= kv


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, block_mask: Any = None) -> torch.Tensor:
        # three buffers (torch 2.7's CPU Inductor refuses q, k, v that are one buffer), none a
        # Linear's 2-D view (CPU Inductor's flex lowering refuses that too, wrapped or not)
        return self.proj(flex_attention(torch.sin(x), torch.cos(x), x + 1, block_mask=block_mask))


def mask_inside(x: torch.Tensor) -> torch.Tensor:
    bm = create_block_mask(causal, 1, 1, x.shape[-2], x.shape[-2], device=str(x.device))
    return flex_attention(torch.sin(x), torch.cos(x), x + 1, block_mask=bm)


def _snap() -> None:
    """Dynamo's counters so far (``torch._dynamo.reset()`` clears them), added up."""
    STATS["graph_breaks"] += sum(counters["graph_break"].values())
    STATS["unique_graphs"] += counters["stats"]["unique_graphs"]
    STATS["break_reasons"] += [r[:150] for r in counters["graph_break"]]


def _try(errors: Dict[str, str], label: str, fn: Any) -> Optional[torch.Tensor]:
    try:
        return fn()
    except Exception as exc:
        errors[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("mode", help="none | all | the name of one site")
    ap.add_argument("--backends", default="aot_eager,inductor")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    found = sites()
    originals = {n: t[k] for n, _, t, k in found}
    wrappers = {}
    for n, owner, table, key in found:
        if args.mode in ("all", n):
            wrappers[n] = wrapt.FunctionWrapper(table[key], _counting(n))
            _put(owner, table, key, wrappers[n])
    dev = args.device
    torch.manual_seed(0)
    x = torch.randn(1, 2, 128, 16, device=dev)
    model = Model().to(dev)
    outs: List[Optional[torch.Tensor]] = []
    errors: Dict[str, str] = {}
    with torch.no_grad():
        bm = create_block_mask(causal, 1, 1, 128, 128, device=dev)
        bm64 = create_block_mask(causal, 1, 1, 64, 64, device=dev)
        outs += [model(x), model(x, bm)]
        for backend in args.backends.split(","):
            _snap()
            torch._dynamo.reset()
            cm = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
            outs.append(_try(errors, f"model/{backend}", lambda: cm(x, bm)))
            outs.append(_try(errors, f"recompile/{backend}", lambda: cm(x[:, :, :64].contiguous(), bm64)))
            fn = torch.compile(mask_inside, backend=backend, fullgraph=True)
            outs.append(_try(errors, f"mask_inside/{backend}", lambda: fn(x)))
    if dev != "cpu":  # training: FlexAttention has no backward on CPU
        for backend in args.backends.split(","):
            _snap()
            torch._dynamo.reset()
            xg = x.clone().requires_grad_(True)
            cm = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)

            def step() -> torch.Tensor:
                out = cm(xg, bm)
                out.sum().backward()
                return xg.grad  # type: ignore[return-value]

            outs.append(_try(errors, f"backward/{backend}", step))
    _snap()
    for n, owner, table, key in found:
        if n in wrappers:
            assert table[key] is wrappers[n], n
            _put(owner, table, key, originals[n])
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "wrapt": wrapt.__version__,
                "mode": args.mode,
                **STATS,
                "digest": [None if o is None else round(float(o.double().sum()), 4) for o in outs],
                "calls": CALLS,
                "errors": errors,
                "restored": all(t[k] is originals[n] for n, _, t, k in found),
                "sites": [n for n, *_ in found],
            }
        )
    )


if __name__ == "__main__":
    main()
