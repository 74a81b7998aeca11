"""fusionguard in one minute (CPU is enough).

1. flex_attention called eagerly runs the dense kernel: fusionguard logs it and, in strict mode,
   stops it before it allocates the score matrix.
2. The same attention under torch.compile (Inductor) is reported fused, and nothing dense runs.

    python examples/quickstart.py            # writes ./fusionguard.jsonl
"""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def main() -> None:
    fusionguard.enable(strict=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, HQ, HKV, L, D = 1, 4, 2, 128, 16
    q = torch.randn(B, HQ, L, D, device=device)
    k = torch.randn(B, HKV, L, D, device=device)
    v = torch.randn(B, HKV, L, D, device=device)
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=L, KV_LEN=L, device=device)

    print("\n== 1. eager flex_attention, strict mode ==")
    try:
        flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    except fusionguard.DenseFallbackError as err:
        print(err)

    print("\n== 2. the same call under torch.compile (Inductor) ==")
    compiled = torch.compile(flex_attention)
    out = compiled(q, k, v, block_mask=mask, enable_gqa=True)
    with fusionguard.allow_dense():  # a deliberate dense reference, allowed and logged as such
        ref = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    print("max |fused - dense| =", (out - ref).abs().max().item())

    print("\n== what fusionguard recorded ==")
    for e in fusionguard.events():
        if e["event"] in ("flex_call", "flex_compile"):
            print(
                f"  {e['event']:<12} {e['phase']:<8} path={e['path']:<6} traced={e['traced']!s:<5} "
                f"cause={e['cause']!s:<11} template={e.get('template')!s:<5} allowed={e.get('allowed')}"
            )
    dense = [e for e in fusionguard.events("flex_call") if not e["allowed"]]
    fused = fusionguard.events("flex_compile")
    print(f"\nverdict: {len(dense)} dense call(s) caught, {len(fused)} fused FlexAttention kernel(s) compiled")
    fusionguard.disable()
    print("the whole story, from the log: fusionguard report fusionguard.jsonl")


if __name__ == "__main__":
    main()
