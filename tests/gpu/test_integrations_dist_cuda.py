"""The framework callbacks' ``stop_on_dense`` under torchrun on two GPUs with NCCL, where a rank
stopping alone leaves the others *waiting* in their next collective (gloo fails it: the CPU test,
tests/test_integrations_dist.py, whose checks these are). Its all-reduce then runs on the GPU
(``torch.cuda.current_device()``). Needs two CUDA devices, transformers and lightning
(tests/gpu/requirements-integrations.txt)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_integrations_dist import check_hf_stop, check_lightning_stop  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(autouse=True)
def on_cuda(monkeypatch):
    monkeypatch.setenv("FG_INTEG_DEVICE", "cuda")  # read by tests/integrations_dist_worker.py


def test_hf_stop_on_dense_nccl_every_rank_stops(tmp_path):
    check_hf_stop(tmp_path)


def test_lightning_stop_on_dense_nccl_every_rank_stops(tmp_path):
    check_lightning_stop(tmp_path)
