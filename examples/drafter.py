"""A small speculative-decoding drafter (DFlash-style, as in the first reports of this failure), guarded.

Packed documents form the context; at random *anchors* the drafter predicts a block of the next
tokens. Each draft block attends (one FlexAttention call per layer, GQA) to

* the context *prefix* up to and including its anchor, inside the anchor's own document only
  (document isolation: packed neighbours are invisible), and
* its own draft block, bidirectionally (the other blocks are invisible),

through a BlockMask built with ``create_block_mask`` and a ``mask_mod`` reading document ids. Every
layer's events are attributed by ``fusionguard.watch`` (``layers.0.attn``, ...).

    python examples/drafter.py --mode eager             # dense, caught and named (eager_call)
    python examples/drafter.py --mode eager --strict    # stopped before the dense kernel allocates
    python examples/drafter.py --mode compiled          # torch.compile(flex_attention): fused
    python examples/drafter.py --mode aot_eager         # compiled, but a non-fusing backend: dense
    python examples/drafter.py --mode recompile         # dynamic=False, recompile_limit=1, a new
                                                        # packed length each step: fused, then dense

On a GPU it trains: forward, backward and an AdamW step per step, seed sizes (bf16, 32/8 heads,
head_dim 128, 128 anchors x 16 = 2048 query tokens, 8192 context + 2048 draft = 10240 KV tokens).
On CPU it runs inference only (forward, under ``torch.no_grad()``), at tiny sizes (4/2 heads,
head_dim 16, a few hundred tokens): PyTorch refuses FlexAttention gradients on CPU. ``--size``
overrides the choice (``tiny``, or ``seed``: the reference sizes of those first reports).

It ends by printing ``fusionguard report`` for its own log (``--log``, default
``drafter-<mode>.jsonl``, overwritten). Exit status: 0, or 1 when strict mode stopped the run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import fusionguard

MODES = ("eager", "compiled", "aot_eager", "recompile")


@dataclass
class Size:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    context: int  # packed context tokens (first step; `recompile` grows it each step)
    anchors: int
    block: int  # draft tokens per anchor
    grow: int  # `recompile`: context tokens added per step
    dtype: torch.dtype


SIZES = {
    "tiny": Size(
        hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=256, context=256, anchors=8, block=8, grow=64, dtype=torch.float32
    ),
    "seed": Size(
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        layers=2,
        vocab=4096,
        context=8192,
        anchors=128,
        block=16,
        grow=512,
        dtype=torch.bfloat16,
    ),
}


# -- data: packed documents, anchors, the anchor/block mask ----------------------------------------


def pack_documents(context: int, vocab: int, gen: torch.Generator, device: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random documents packed back to back: token ids and a document id per position."""
    lengths: List[int] = []
    while sum(lengths) < context:
        lengths.append(int(torch.randint(context // 8, context // 2, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - context
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    tokens = torch.randint(1, vocab, (context,), generator=gen)
    return tokens.to(device), doc_ids.to(device)


def sample_anchors(doc_ids: torch.Tensor, n: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """Anchor positions whose whole draft block (the next `block` tokens) stays in the anchor's document."""
    ids = doc_ids.cpu()
    ends = torch.zeros_like(ids)
    for d in ids.unique():
        where = (ids == d).nonzero().flatten()
        ends[where] = where[-1]
    ok = (torch.arange(len(ids)) + block <= ends).nonzero().flatten()
    pick = ok[torch.randperm(len(ok), generator=gen)[:n]].sort().values
    return pick.to(doc_ids.device)


def anchor_block_mask(doc_ids: torch.Tensor, anchors: torch.Tensor, block: int) -> BlockMask:
    """Query i (draft block i // block) sees context kv <= its anchor in the anchor's document, and its own block."""
    context = doc_ids.shape[0]
    q_len = anchors.shape[0] * block

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block
        anchor = anchors[blk]
        in_context = kv_idx < context
        ctx_kv = torch.clamp(kv_idx, max=context - 1)
        prefix = in_context & (kv_idx <= anchor) & (doc_ids[ctx_kv] == doc_ids[anchor])
        own_block = (~in_context) & ((kv_idx - context) // block == blk)
        return prefix | own_block

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=context + q_len, device=str(doc_ids.device))


def make_batch(size: Size, context: int, gen: torch.Generator, device: str):
    tokens, doc_ids = pack_documents(context, size.vocab, gen, device)
    anchors = sample_anchors(doc_ids, size.anchors, size.block, gen)
    offsets = torch.arange(size.block, device=device)
    # a draft block: the anchor token, then mask tokens (id 0); labels: the `block` tokens after the anchor
    draft = torch.zeros(size.anchors, size.block, dtype=torch.long, device=device)
    draft[:, 0] = tokens[anchors]
    labels = tokens[(anchors[:, None] + 1 + offsets).clamp(max=context - 1)]
    mask = anchor_block_mask(doc_ids, anchors, size.block)
    return tokens[None], draft.reshape(1, -1), labels.reshape(1, -1), mask


# -- the model -------------------------------------------------------------------------------------


class DraftAttention(nn.Module):
    """GQA attention: draft queries over [context ; draft] keys/values, one FlexAttention call."""

    def __init__(self, size: Size, attend: Callable) -> None:
        super().__init__()
        self.h, self.hkv, self.d = size.heads, size.kv_heads, size.head_dim
        self.q_proj = nn.Linear(size.hidden, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(size.hidden, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(size.hidden, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, size.hidden, bias=False)
        self.attend = attend

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: BlockMask) -> torch.Tensor:
        B, Q, _ = x.shape
        kv_in = torch.cat([context, x], dim=1)
        q = self.q_proj(x).view(B, Q, self.h, self.d).transpose(1, 2)
        k = self.k_proj(kv_in).view(B, -1, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, -1, self.hkv, self.d).transpose(1, 2)
        out = self.attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.h * self.d))


class DraftLayer(nn.Module):
    def __init__(self, size: Size, attend: Callable) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(size.hidden)
        self.attn = DraftAttention(size, attend)
        self.norm2 = nn.RMSNorm(size.hidden)
        self.mlp = nn.Sequential(nn.Linear(size.hidden, 2 * size.hidden), nn.SiLU(), nn.Linear(2 * size.hidden, size.hidden))

    def forward(self, x, context, mask):
        x = x + self.attn(self.norm1(x), context, mask)
        return x + self.mlp(self.norm2(x))


class Drafter(nn.Module):
    """The context's hidden states stand in for the target model's (a frozen embedding here)."""

    def __init__(self, size: Size, attend: Callable) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.hidden)
        self.layers = nn.ModuleList(DraftLayer(size, attend) for _ in range(size.layers))
        self.norm = nn.RMSNorm(size.hidden)
        self.head = nn.Linear(size.hidden, size.vocab, bias=False)

    def forward(self, tokens, draft, mask):
        with torch.no_grad():
            context = self.embed(tokens)
        x = self.embed(draft)
        for layer in self.layers:
            x = layer(x, context, mask)
        return self.head(self.norm(x))


# -- the four ways to call FlexAttention -----------------------------------------------------------


def eager_attend(q, k, v, mask):
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


def make_attend(mode: str) -> Callable:
    if mode == "eager":
        return eager_attend
    if mode in ("compiled", "aot_eager"):
        # the reported pattern: flex_attention compiled on its own, called from eager modules
        flex = torch.compile(flex_attention, backend="inductor" if mode == "compiled" else "aot_eager")

        def attend(q, k, v, mask):
            return flex(q, k, v, block_mask=mask, enable_gqa=True)

        return attend
    if mode == "recompile":
        torch._dynamo.config.recompile_limit = 1
        return torch.compile(eager_attend, dynamic=False)
    raise ValueError(mode)


# -- main ------------------------------------------------------------------------------------------


def peak_text(device: str) -> str:
    """Peak allocated CUDA memory so far (``watch`` resets PyTorch's peak counter per layer;
    fusionguard keeps the true peak)."""
    if not device.startswith("cuda"):
        return ""
    return f"  peak so far {fusionguard.peak_memory_allocated() / 1e9:.2f} GB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, default="eager")
    p.add_argument("--strict", action="store_true", help="raise DenseFallbackError before a dense kernel runs")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="default: seed on CUDA, tiny on CPU")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--log", default=None, help="fusionguard log (default drafter-<mode>.jsonl, overwritten)")
    args = p.parse_args(argv)

    device = args.device
    train = device.startswith("cuda")
    size = SIZES[args.size or ("seed" if train else "tiny")]
    if args.layers:
        size.layers = args.layers
    log = args.log or f"drafter-{args.mode}.jsonl"
    if os.path.exists(log):
        os.remove(log)

    fusionguard.enable(strict=args.strict, log_path=log)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = Drafter(size, make_attend(args.mode)).to(device=device, dtype=size.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None
    print(
        f"drafter: mode={args.mode} strict={args.strict} device={device} "
        f"{'training' if train else 'inference only (CPU: no FlexAttention gradients)'}; "
        f"{size.layers} layers, {size.heads}/{size.kv_heads} heads, head_dim {size.head_dim}, "
        f"{size.anchors}x{size.block} draft tokens, log {log}"
    )

    stopped = None
    with fusionguard.watch(model):
        for step in range(args.steps):
            context = size.context + (step * size.grow if args.mode == "recompile" else 0)
            tokens, draft, labels, mask = make_batch(size, context, gen, device)
            n_dense = len(fusionguard.events("flex_call"))
            t0 = time.perf_counter()
            try:
                with torch.set_grad_enabled(train):
                    logits = model(tokens, draft, mask)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
                    if train:
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            except fusionguard.DenseFallbackError as err:
                stopped = err
                print(f"step {step}: STOPPED by fusionguard (strict){peak_text(device)}\n{err}")
                break
            calls = fusionguard.events("flex_call")[n_dense:]
            verdict = ", ".join(sorted({f"{e['phase']} {e['path']} ({e['cause']})" for e in calls})) or "no dense call"
            print(
                f"step {step}: KV={context + draft.shape[1]} loss={loss.item():.3f} "
                f"{time.perf_counter() - t0:.2f}s{peak_text(device)}  flex: {verdict}"
            )

    fused = fusionguard.events("flex_compile")
    dense = [e for e in fusionguard.events("flex_call") if e["path"] == "dense"]
    print(
        f"verdict: {len(dense)} dense FlexAttention call(s), {len(fused)} fused kernel(s) compiled"
        + (" (run stopped in strict mode)" if stopped else "")
    )
    fusionguard.disable()
    print()
    sys.stdout.flush()
    subprocess.run([sys.executable, "-m", "fusionguard", "report", log])  # the report, as from a shell
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
