"""The documentation's GPU-only blocks (``<!-- doc: gpu ... -->``: training, where FlexAttention
needs its CUDA backward) run on CUDA, each in a fresh directory with its glue; the outputs marked
``gpu`` (``fusionguard doctor`` on the H200) compared with the real ones, normalised as on CPU
(tests/docs_blocks.py). ``FUSIONGUARD_DOCS_UPDATE=1`` rewrites those outputs from this machine's.

Packages: those of tests/gpu/test_integrations_cuda.py (transformers, accelerate, tensorboard,
lightning). Run: ``python -m pytest -q -rP tests/gpu/test_docs_cuda.py``."""

from __future__ import annotations

import warnings

import docs_blocks as db
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ALL = db.blocks()
GPU = [b for b in ALL if b.kind == "gpu"]
GPU_OUTPUT = [b for b in ALL if b.kind == "output" and "gpu" in b.flags]


@pytest.fixture(scope="module")
def producers(tmp_path_factory):
    return db.Producers(tmp_path_factory.mktemp, device="cuda")


def test_there_are_gpu_blocks():
    assert GPU and GPU_OUTPUT  # (collection above is not empty: a pass here means the blocks below ran)


@pytest.mark.parametrize("block", GPU, ids=[b.id for b in GPU])
def test_gpu_block(block, tmp_path):
    import fusionguard  # (here: the module-level imports stay those of the other GPU tests)

    torch._dynamo.reset()
    with db.cleaned():
        db.run_block(block, tmp_path, device="cuda")
        dense = [e for e in fusionguard.events("flex_call") if not e.get("allowed")]
    assert not dense, dense[:2]  # the training blocks run fused (strict ones would have raised)


@pytest.mark.parametrize("block", GPU_OUTPUT, ids=[b.id for b in GPU_OUTPUT])
def test_gpu_output_block(block, producers):
    real, dirs = producers.get(block.args["of"])
    ok, why = db.matches(block, real)
    if not ok and db.UPDATE and db.update(block, db.shown(real, *dirs)):
        warnings.warn(f"FUSIONGUARD_DOCS_UPDATE: rewrote the output at {block.id}", stacklevel=1)
        return
    assert ok, f"{block.id}: the documented output is not the real one (FUSIONGUARD_DOCS_UPDATE=1 rewrites it)\n{why}"
