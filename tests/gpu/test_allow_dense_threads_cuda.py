"""``allow_dense()``'s thread rule on a CUDA GPU (issue #27, part 1): autograd runs a CUDA backward
on its own device thread, where no ``allow_dense()`` block of the caller is visible. The backward
of an allowed forward is allowed there (by the verdict its forward left on the autograd ctx, or,
for an AOTAutograd-compiled backward, on its logsumexp); any other backward is blocked, even
while another thread holds ``allow_dense()`` open. CPU side: tests/test_allow_dense_threads.py.

Skipped (and so not counted as passing) on machines without CUDA; run on the device machine.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import causal, flex_events
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusionguard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]


def make(L=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, 2, L, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=L, KV_LEN=L, device="cuda")
    return q, k, v, mask


class HeldOpen:
    """Another thread sitting inside ``allow_dense()`` until released."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, name="fg-holds-allow-dense")

    def _hold(self):
        with fusionguard.allow_dense():
            self.inside.set()
            self.release.wait(120)

    def __enter__(self):
        self.thread.start()
        assert self.inside.wait(30)

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(30)


def backward(out):
    out.float().square().sum().backward()
    torch.cuda.synchronize()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_an_allowed_forwards_backward_runs_on_the_device_thread(guard, dynamo_reset, compiled):
    attend = torch.compile(flex_attention, backend="aot_eager") if compiled else flex_attention
    guard(strict=True)
    q, k, v, mask = make()
    with fusionguard.allow_dense():
        out = attend(q, k, v, block_mask=mask)
    backward(out)  # no block open anywhere
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()
    fwd, bwd = flex_events()[-2:]  # (an earlier test module's events may still be in memory)
    assert (fwd["phase"], fwd["action"]) == ("forward", "allow")
    assert (bwd["phase"], bwd["action"]) == ("backward", "allow")
    assert bwd["thread"] != fwd["thread"], "the backward did not run on autograd's device thread"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_an_unallowed_forwards_backward_is_blocked_while_another_thread_allows(guard, dynamo_reset, compiled):
    attend = torch.compile(flex_attention, backend="aot_eager") if compiled else flex_attention
    guard(strict=False)
    q, k, v, mask = make()
    with pytest.warns(fusionguard.DenseFallbackWarning):
        out = attend(q, k, v, block_mask=mask)
    guard(strict=True)
    with HeldOpen(), pytest.raises(fusionguard.DenseFallbackError, match="dense FlexAttention backward"):
        backward(out)
    assert q.grad is None
    assert [(e["phase"], e["action"]) for e in flex_events()] == [("forward", "warn"), ("backward", "raise")]


def test_a_backward_with_no_forward_record_is_blocked_while_another_thread_allows(guard):
    """The forward ran before enable(): nothing on its ctx. Before issue #27's fix, any open block
    in any thread let this backward through on the device thread."""
    q, k, v, mask = make()
    out = flex_attention(q, k, v, block_mask=mask)
    guard(strict=True)
    with HeldOpen(), pytest.raises(fusionguard.DenseFallbackError, match="dense FlexAttention backward"):
        backward(out)
    assert q.grad is None
    (event,) = flex_events()
    assert (event["phase"], event["action"]) == ("backward", "raise")


def test_a_checkpoint_recompute_needs_the_backward_on_the_calling_thread(guard):
    """Activation checkpointing re-runs the forward during the backward: on the device thread
    that forward is outside the block and blocked; with multithreaded backward off (the
    documented way) the backward runs on this thread, inside the block, and is allowed."""
    from torch.utils.checkpoint import checkpoint

    guard(strict=True)

    def attend(q, k, v, mask):
        return flex_attention(q, k, v, block_mask=mask)

    q, k, v, mask = make()
    with fusionguard.allow_dense():
        out = checkpoint(attend, q, k, v, mask, use_reentrant=False)
        with pytest.raises(fusionguard.DenseFallbackError, match="dense FlexAttention forward") as info:
            backward(out)  # the re-run forward, on the device thread
    assert q.grad is None
    assert info.value.event.get("recompute") is True and info.value.event.get("native_thread") is True
    assert "torch.autograd.set_multithreading_enabled(False)" in str(info.value), "the error names the way to allow it"

    q, k, v, mask = make(seed=1)
    with fusionguard.allow_dense(), torch.autograd.set_multithreading_enabled(False):
        out = checkpoint(attend, q, k, v, mask, use_reentrant=False)
        backward(out)
    assert q.grad is not None
    last = flex_events()[-3:]
    assert [(e["phase"], e["action"]) for e in last] == [("forward", "allow"), ("forward", "allow"), ("backward", "allow")]
    assert last[0]["thread"] == last[1]["thread"] == last[2]["thread"], "the backward left the calling thread"
