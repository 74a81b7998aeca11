"""fusionguard's early warnings (CPU is enough): what it says *before* FlexAttention goes dense.

1. Recompile pressure: a compiled step that sees a new sequence length every call
   (``dynamic=False``) is recompiled each time; at Dynamo's recompile limit (8) it would run
   eagerly, with dense FlexAttention, for the rest of the job. fusionguard warns at half the
   limit (4 compiles), naming what varies and the fix; the fix (``mark_dynamic``) is applied.
2. Attention that never reaches FlexAttention: a watched model whose attention runs through
   SDPA is told once.

    python examples/early_warnings.py                        # Inductor (a few compiles: ~1 min on CPU)
    python examples/early_warnings.py --backend aot_eager    # quick; the calls themselves run dense
    fusionguard report fusionguard.jsonl                     # the same story from the log
"""

import argparse
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import flex_attention

import fusionguard


def attention_step(q, k, v):
    return flex_attention(q, k, v)


class SdpaBlock(nn.Module):
    """An attention block that (by mistake) uses SDPA, not FlexAttention."""

    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--log", default="fusionguard.jsonl")
    args = parser.parse_args()
    fusionguard.enable(log_path=args.log)
    warnings.simplefilter("ignore", fusionguard.DenseFallbackWarning)  # aot_eager: every call is dense
    warnings.filterwarnings("always", message="fusionguard: recompile pressure")
    B, H, D = 1, 2, 16

    print("== 1. a new sequence length every step, dynamic=False ==")
    step = torch.compile(attention_step, backend=args.backend, dynamic=False)
    for L in (64, 80, 96, 112):
        q = torch.randn(B, H, L, D)
        step(q, q, q)
        print(f"  step with L={L}")
    (pressure,) = fusionguard.events("recompile_pressure")
    print(
        f"  -> recompile_pressure: {pressure['function']} compiled {pressure['compiles']} of {pressure['limit']} times "
        f"({pressure['varies']})"
    )
    print(f"     fix: {pressure['fix']}")

    print("== the fix: mark the length dim dynamic (one graph for every length) ==")
    torch._dynamo.reset()  # (fusionguard counts anew too)
    counter = CompileCounterWithBackend(args.backend)
    step = torch.compile(attention_step, backend=counter, dynamic=False)
    for L in (64, 80, 96, 112, 128, 144):
        q = torch.randn(B, H, L, D)
        torch._dynamo.mark_dynamic(q, 2)
        step(q, q, q)
    print(
        f"  6 lengths: {counter.frame_count} compile(s), "
        f"{len(fusionguard.events('recompile_pressure'))} recompile_pressure event (the one above)"
    )

    print("== 2. a watched model whose attention never reaches FlexAttention ==")
    model = SdpaBlock()
    with warnings.catch_warnings(record=True) as caught, fusionguard.watch(model):
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(B, H, 32, D))
    told = [w for w in caught if "without any FlexAttention call" in str(w.message)]
    print(f"  3 forwards, {len(told)} warning, {len(fusionguard.events('no_flex_calls'))} no_flex_calls event")
    print(f"  -> {told[0].message}")

    fusionguard.disable()
    print(f"the whole story, from the log: fusionguard report {args.log}")


if __name__ == "__main__":
    main()
