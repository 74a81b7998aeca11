"""Dense masks, caught before they allocate (CPU is enough).

``create_block_mask`` run eagerly builds the whole B x H x Q x KV mask (about 10 bytes per
element: 2.7 GB at 16k tokens, 170 GB at 128k) before any attention runs. fusionguard estimates
each eager build first; above ``mask_limit`` warn mode warns at your line and strict mode stops it.

1. a mask rebuilt eagerly in every step: one warning per step at the loop's line, repeats sampled;
2. strict mode: the build is stopped before it allocates;
3. the fix: the mask creation compiled, built once outside the loop (recorded as compiled).

    python examples/dense_mask.py            # writes ./fusionguard.jsonl

The sizes are tiny; ``mask_limit`` is set low so that they count as "too big" here. The default
limit is 10 % of the building device's memory.
"""

import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask

import fusionguard

L = 1024  # tokens: an eager block mask of 1 x 1 x 1024 x 1024 is estimated at about 10.5 MB
LIMIT = 4 << 20  # 4 MiB, for the demo


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def main() -> None:
    fusionguard.enable(mask_limit=LIMIT)
    print("== 1. warn mode: the mask rebuilt eagerly in every step ==")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fusionguard.DenseFallbackWarning)
        for _step in range(3):
            create_block_mask(causal, 1, 1, L, L, device="cpu")  # the line each warning points at
    print(str(caught[0].message))
    print(f"({len(caught)} warnings, at {caught[0].filename}:{caught[0].lineno})")

    print("\n== 2. strict mode: stopped before it allocates ==")
    fusionguard.enable(strict=True, mask_limit=LIMIT)
    try:
        create_block_mask(causal, 1, 1, L, L, device="cpu")
    except fusionguard.DenseFallbackError as err:
        print(err)

    print("\n== 3. the fix: compiled mask creation, built once outside the loop ==")
    build = torch.compile(create_block_mask)
    mask = build(causal, 1, 1, L, L, device="cpu")
    for _step in range(3):
        pass  # ... flex_attention(q, k, v, block_mask=mask) in each step
    print(f"built {mask.shape} once, compiled: no dense mask, nothing raised")

    print("\n== what fusionguard recorded ==")
    for e in fusionguard.events("mask_build"):
        print(f"  mask_build path={e['path']:<8} action={e.get('action')!s:<5} estimated={e.get('estimated_bytes')}")
    dense = [e for e in fusionguard.events("mask_build") if e["path"] == "dense"]
    print(f"verdict: {len(dense)} eager mask build(s) seen (1 blocked), 1 compiled")
    fusionguard.disable()
    print("\nthen: fusionguard report fusionguard.jsonl")


if __name__ == "__main__":
    main()
