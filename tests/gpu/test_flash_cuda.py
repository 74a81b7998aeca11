"""The FLASH backend (CuTe DSL templates, flash-attn-4) on a CUDA GPU (#35 part 1).

``flex_attention(..., kernel_options={"BACKEND": "FLASH"})`` under ``torch.compile`` lowers to the
CuTe DSL templates instead of Triton: fused both ways, template ``flash``. Eager, the same call is
dense. Each test checks fusionguard's verdict against what ran.

Needs ``flash_attn.cute`` (flash-attn-4 and nvidia-cutlass-dsl: ``tests/gpu/install_fa4.sh``).
Below SM100 torch refuses a ``score_mod`` buffer that needs gradients and a deterministic
block-mask backward: none is used here. Skipped without CUDA or without ``flash_attn.cute``; run
on the device machine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT, causal, flex_events, read_jsonl
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard
from fusionguard.core import state as _state


def _flash_missing() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        if importlib.util.find_spec("flash_attn.cute") is None:
            return "flash_attn.cute is not importable (install flash-attn-4: tests/gpu/install_fa4.sh)"
    except ImportError as exc:
        return f"flash_attn.cute is not importable ({exc}; install flash-attn-4: tests/gpu/install_fa4.sh)"
    return ""


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(_flash_missing()), reason=_flash_missing() or "-"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

FLASH = {"BACKEND": "FLASH"}
STEPS = 3


def make(L=1024, H=4, D=128, seed=0, grad=True):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk():
        return torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)

    q, k, v = mk(), mk(), mk()
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=L, KV_LEN=L, device="cuda")
    return q, k, v, mask


def records(kind="flex_compile"):
    return [e for e in fusionguard.events() if e["event"] == kind]


def test_flash_forward_and_backward_are_fused_and_right(guard, dynamo_reset):
    """Compiled training steps with BACKEND="FLASH": fused records with template flash, strict
    mode never fires, every run counted, and the numbers agree with the Triton kernels'."""
    guard(strict=True)
    fn = torch.compile(flex_attention)
    for _ in range(STEPS):
        q, k, v, mask = make()
        out = fn(q, k, v, block_mask=mask, kernel_options=FLASH)
        out.float().square().sum().backward()
    torch.cuda.synchronize()
    compiles = records()
    assert flex_events() == []
    assert {c["phase"] for c in compiles} == {"forward", "backward"}, compiles
    assert all(c["path"] == "fused" for c in compiles)
    assert {c["template"] for c in compiles if c["phase"] == "forward"} == {"flash"}, compiles
    print("FLASH templates:", sorted({(c["phase"], c["template"]) for c in compiles}))
    assert _state.STATE.counts.get("fused_runs_forward") == STEPS
    assert _state.STATE.counts.get("fused_runs_backward") == STEPS
    runs = records("flex_run")
    assert {r["template"] for r in runs if r["phase"] == "forward"} == {"flash"}
    # the same math as Triton's kernels (output and the query's gradient)
    fusionguard.disable()
    q, k, v, mask = make(seed=1)
    flash = fn(q, k, v, block_mask=mask, kernel_options=FLASH)
    flash.float().square().sum().backward()
    gq, q.grad = q.grad.clone(), None
    ref = torch.compile(flex_attention)(q, k, v, block_mask=mask)
    ref.float().square().sum().backward()
    torch.testing.assert_close(flash, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gq, q.grad, atol=5e-2, rtol=5e-2)


class Attention(nn.Module):
    def __init__(self, d=512, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, device="cuda", dtype=torch.bfloat16)
        self.out = nn.Linear(d, d, device="cuda", dtype=torch.bfloat16)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = flex_attention(q, k, v, block_mask=mask, kernel_options=FLASH)
        return self.out(o.transpose(1, 2).reshape(b, n, d))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Attention(), Attention()])

    def forward(self, x, mask):
        for layer in self.layers:
            x = x + layer(x, mask)
        return x


def test_flash_compiled_model_per_layer_names_and_counts(guard, dynamo_reset):
    """torch.compile(model) whose layers ask for FLASH: one record per layer and phase, template
    flash forward, and summary() counts every layer's fused calls both ways."""
    torch.manual_seed(0)
    model = Model()
    guard(strict=True)
    L = 1024
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=L, KV_LEN=L, device="cuda")
    compiled = torch.compile(model)
    with fusionguard.watch(model):
        for _ in range(STEPS):
            x = torch.randn(1, L, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            compiled(x, mask).float().square().mean().backward()
        torch.cuda.synchronize()
        rows = {(r["layer"], r["phase"]): r for r in fusionguard.summary()}
    compiles = records()
    assert flex_events() == []
    layers = ["layers.0", "layers.1"]
    assert sorted({(c["layer"], c["phase"]) for c in compiles}) == sorted((x, p) for x in layers for p in ("forward", "backward"))
    assert {c["template"] for c in compiles if c["phase"] == "forward"} == {"flash"}
    for layer in layers:
        for phase in ("forward", "backward"):
            row = rows[(layer, phase)]
            assert (row["dense"], row["fused"]) == (0, STEPS), (layer, phase, row)
    assert _state.STATE.counts.get("fused_runs_forward") == STEPS * 2
    assert _state.STATE.counts.get("fused_runs_backward") == STEPS * 2


def test_flash_records_from_the_cache_in_a_new_process(tmp_path):
    """The second process loads the FLASH graphs from Inductor's caches: records again, from the
    cache, with template flash (the sidecar keeps it)."""
    code = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, {root!r})
        import fusionguard
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        fusionguard.enable(strict=True, log_path=sys.argv[1])
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 1024, 1024, device="cuda")
        q, k, v = (torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        torch.compile(flex_attention)(q, k, v, block_mask=mask, kernel_options={{"BACKEND": "FLASH"}}).float().sum().backward()
        torch.cuda.synchronize()
        fusionguard.disable()
        """
    ).format(root=str(ROOT))
    script = tmp_path / "run.py"
    script.write_text(code)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    sources, templates = [], []
    for i in range(2):
        log = tmp_path / f"{i}.jsonl"
        proc = subprocess.run([sys.executable, str(script), str(log)], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        recs = [e for e in read_jsonl(log) if e["event"] == "flex_compile"]
        assert {r["phase"] for r in recs} == {"forward", "backward"}, recs
        assert [e for e in read_jsonl(log) if e["event"] == "flex_call"] == []
        sources.append({r["source"] for r in recs})
        templates.append({r["template"] for r in recs if r["phase"] == "forward"})
    assert sources == [{"lowering"}, {"cache"}]
    assert templates == [{"flash"}, {"flash"}]


def test_eager_flash_is_dense(guard):
    """Eager, BACKEND="FLASH" still runs the dense kernels: warned in warn mode (both phases),
    stopped before it allocates in strict mode."""
    guard()
    q, k, v, mask = make()
    flex_attention(q, k, v, block_mask=mask, kernel_options=FLASH).float().sum().backward()
    torch.cuda.synchronize()
    events = flex_events()
    assert sorted((e["phase"], e["path"], e["cause"]) for e in events) == [
        ("backward", "dense", "eager_call"),
        ("forward", "dense", "eager_call"),
    ]
    fusionguard.enable(strict=True, log_path=False)
    q, k, v, mask = make()
    with pytest.raises(fusionguard.DenseFallbackError, match="eager_call"):
        flex_attention(q, k, v, block_mask=mask, kernel_options=FLASH)


def test_eager_flash_lse_is_warned_where_wrong(guard):
    """#35: a dense FLASH call's LSE against the fused Triton kernel's (natural log): warned
    (RuntimeWarning, with the factor) exactly when it is wrong on this release and device."""
    import warnings

    q, k, v, mask = make(grad=False)
    ref = torch.compile(flex_attention)(q, k, v, block_mask=mask, return_lse=True)[1].float()
    guard()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lse = flex_attention(q, k, v, block_mask=mask, return_lse=True, kernel_options=FLASH)[1].float()
    ratio = (lse / ref).mean().item()
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning) and "LSE" in str(w.message)]
    print(f"dense FLASH LSE / fused Triton LSE on torch {torch.__version__}: {ratio:.4f}")
    if abs(ratio - 1) < 2e-2:
        assert said == []
    else:
        assert len(said) == 1 and abs(float(said[0].split("x too large")[0].split()[-1]) - ratio) < 2e-2, said
