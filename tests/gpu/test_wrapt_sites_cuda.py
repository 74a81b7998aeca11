"""#24 on a GPU, in training: fusionguard's wrapt function wrappers at the attribute sites
(autograd forward/backward, ``post_compile``, Dynamo's flex tracing method,
``OptimizedModule.__init__``, the template selectors, ``setup_compilation_env``) change nothing
``torch.compile`` does. A model compiled whole by Inductor (``fullgraph=True``,
``dynamic=False``), forward and backward on two sequence lengths, with fusionguard off and then
on: the same compiles (one per length, no graph break), the same outputs and gradients, and with
fusionguard on the fused forward and backward runs counted; eager dense training still links
the backward to its forward through the wrapped autograd op; ``disable()`` puts back the very
objects.

    python -m pytest -q -m gpu tests/gpu/test_wrapt_sites_cuda.py
"""

from __future__ import annotations

import pytest
import torch
import wrapt
from compile_models import Model, tokens
from conftest import flex_events
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import flex_attention

import fusionguard
from fusionguard import torch_internals as ti

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

SHAPE = dict(h=4, d=64)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _train(model):
    """Two steps at two lengths each: (outputs, gradients, frames compiled, graph breaks)."""
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    outs, grads = [], []
    for length in (256, 128, 256, 128):
        x = tokens(seed=length, device="cuda", requires_grad=True, l=length, dtype=torch.bfloat16, **SHAPE)
        out = compiled(x)
        out.float().sum().backward()
        outs.append(out.detach())
        grads.append(x.grad)
    torch.cuda.synchronize()
    return outs, grads, backend.frame_count, sum(counters["graph_break"].values())


def _attribute_sites():
    cls = ti.autograd_op()
    cfg = ti.compiled_fx_graph()
    var, name = ti.flex_trace_method()
    return [
        vars(cls)["forward"],
        vars(cls)["backward"],
        vars(cfg)["post_compile"],
        vars(var)[name],
        vars(ti.optimized_module())["__init__"],
    ]


def test_compiled_training_is_the_same_with_the_wrappers(guard, fresh_cache):
    torch.manual_seed(0)
    model = Model(**SHAPE).cuda().to(torch.bfloat16)
    originals = _attribute_sites()
    off = _train(model)
    torch._dynamo.reset()
    counters.clear()
    model.zero_grad(set_to_none=True)
    guard(keep_all=True)
    assert all(isinstance(w, wrapt.FunctionWrapper) for w in _attribute_sites())
    on = _train(model)
    assert (off[2], off[3]) == (2, 0), "one compile per length, no graph break (PyTorch alone)"
    assert (on[2], on[3]) == (off[2], off[3]), "the same compiles and no graph break with fusionguard"
    for a, b in zip(off[0] + off[1], on[0] + on[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    runs = {e["phase"] for e in flex_events("flex_run")}
    assert runs == {"forward", "backward"}, "post_compile's record counted both phases' runs"
    assert fusionguard.events("flex_call") == [], "no dense call"
    fusionguard.disable()
    assert all(a is b for a, b in zip(_attribute_sites(), originals))


def test_eager_dense_training_links_the_backward_to_its_forward(guard):
    guard()
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", requires_grad=True) for _ in range(3))
    with pytest.warns(fusionguard.DenseFallbackWarning):
        out = flex_attention(q, k, v)
        out.sum().backward()
    fwd, bwd = [e for e in flex_events() if e["path"] == "dense"][:2]
    assert (fwd["phase"], bwd["phase"]) == ("forward", "backward")
    assert bwd["forward_seq"] == fwd["seq"] and bwd["call_site"] == fwd["call_site"], "the forward's verdict travelled on ctx"
