"""#34 on a CUDA GPU: a fork made after tests/forkserver.py's preloads can use the GPU. Importing
Inductor's ``compile_fx`` asks ``torch.cuda.is_available()`` (torch.utils.cpp_extension, where a
CUDA toolkit is found); asked through the CUDA driver, every later fork is in torch's "bad fork"
state ("Cannot re-initialize CUDA in forked subprocess"). The server starts with
``PYTORCH_NVML_BASED_CUDA_CHECK=1``, so the question goes to NVML and the driver is never touched.
(Where the server does not start at all, e.g. a thread left running after its preloads, every
child is a fresh interpreter: the second test.)

Skipped (and so not counted as passing) on machines without CUDA; run on the device machine."""

from __future__ import annotations

import json
import subprocess
import sys

import forkserver
import pytest
import torch
from conftest import child_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CODE = "import json, torch; x = torch.ones(4, device='cuda'); print(json.dumps([float(x.sum()), torch.cuda.device_count() > 0]))"

# The server's preloads, then a fork that uses the GPU: what each of its children does.
AFTER_PRELOADS = """
import importlib, json, os, sys
for name in %r:
    importlib.import_module(name)
pid = os.fork()
if pid == 0:
    import torch
    try:
        torch.ones(1, device="cuda")
        print(json.dumps("ok"), flush=True)
    except Exception as exc:
        print(json.dumps(str(exc)[:120]), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@pytest.mark.parametrize("nvml", ["1", None])
def test_a_fork_after_the_servers_preloads_uses_the_gpu_only_with_the_nvml_check(nvml):
    env = child_env()
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    if nvml:
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = nvml
    code = AFTER_PRELOADS % (forkserver.PRELOAD,)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    said = json.loads(out.stdout.strip().splitlines()[-1])
    if nvml:
        assert said == "ok"
    else:  # (why the server starts with the NVML check: the driver's answer poisons every fork)
        assert "Cannot re-initialize CUDA in forked subprocess" in said, said


def test_a_child_of_the_tests_uses_the_gpu_forked_or_fresh():
    args = [sys.executable, "-c", CODE]
    out = forkserver.run(args, env=child_env(), capture_output=True, text=True, timeout=120)
    how = forkserver.why_not(args, child_env()) or "forked"
    assert out.returncode == 0, how + "\n" + out.stderr[-3000:]
    assert json.loads(out.stdout) == [4.0, True], how
