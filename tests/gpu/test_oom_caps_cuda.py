"""The oom mode under the allocator's own limits, with ballast (#35 part 2), on a CUDA GPU.

Three ways a process gets less than the driver's free memory, each in its own child process so
the cap and the ballast leave nothing behind: a per-process fraction
(``torch.cuda.set_per_process_memory_fraction``), ``expandable_segments`` with ballast in the
process, and a second process holding most of the GPU. In each, a dense forward predicted not to
fit is blocked before it allocates, with both numbers; allowed on purpose it really runs out of
memory (the ground truth); and a call that fits runs.

Skipped without CUDA; run on the device machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GIB = 1 << 30
HEADROOM = 4 * GIB  # what each scenario leaves this process: the seed forward (about 8.9 GB) cannot fit

CHILD = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    sys.path.insert(0, {root!r})
    import torch
    import fusionguard
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    warnings.simplefilter("ignore")
    how, out = sys.argv[1], sys.argv[2]
    torch.cuda.init()
    dev = torch.device("cuda")
    headroom = {headroom}
    ballast = None
    if how == "fraction":
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + headroom) / torch.cuda.mem_get_info()[1])
    elif how == "expandable":
        ballast = torch.empty(torch.cuda.mem_get_info()[0] - headroom, dtype=torch.uint8, device=dev)
    elif how == "other_process":
        while not os.path.exists(sys.argv[3]):  # the other process holds its ballast
            time.sleep(0.2)
    fusionguard.enable(mode="oom", log_path=False)

    def seed(q_len, kv_len):  # the seed shape: bf16, 32/8 heads, causal
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, 32, q_len, 128, device=dev, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, 8, kv_len, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q_len, kv_len, device=dev)
        return q, k, v, mask

    result = {{"how": how, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}}
    q, k, v, mask = seed(2048, 10240)
    with torch.no_grad():
        try:
            flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
            result["big"] = "ran"
        except fusionguard.DenseFallbackError as exc:
            result["big"] = "blocked"
            result["message"] = str(exc)
            result["predicted"] = exc.event.get("predicted_bytes")
            result["free"] = exc.event.get("free_bytes")
        try:  # the ground truth: allowed on purpose, does it fit?
            with fusionguard.allow_dense():
                flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
            result["truth"] = "fits"
        except torch.OutOfMemoryError:
            result["truth"] = "oom"
        del q, k, v, mask
        torch.cuda.empty_cache()
        q, k, v, mask = seed(512, 1024)
        try:
            flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
            result["small"] = "ran"
        except fusionguard.DenseFallbackError as exc:
            result["small"] = "blocked: " + str(exc).splitlines()[0]
    result["fraction"] = torch.cuda.get_per_process_memory_fraction() if hasattr(torch.cuda, "get_per_process_memory_fraction") else None
    fusionguard.disable()
    json.dump(result, open(out, "w"))
    """
).format(root=str(ROOT), headroom=HEADROOM)

HOLDER = textwrap.dedent(
    """
    import sys, time, torch
    ballast = torch.empty(torch.cuda.mem_get_info()[0] - {headroom} - (1 << 30), dtype=torch.uint8, device="cuda")
    open(sys.argv[1], "w").close()
    time.sleep(600)
    """
).format(headroom=HEADROOM)


def run_child(tmp_path, how, **env):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / f"{how}.json"
    args = [sys.executable, str(script), how, str(out)]
    holder = None
    if how == "other_process":
        ready = tmp_path / "ready"
        (tmp_path / "holder.py").write_text(HOLDER)
        holder = subprocess.Popen([sys.executable, str(tmp_path / "holder.py"), str(ready)])
        args.append(str(ready))
    try:
        proc = subprocess.run(args, env=dict(os.environ, **env), capture_output=True, text=True, timeout=600)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    return result


@pytest.mark.parametrize(
    "how, env",
    [
        ("fraction", {}),
        ("expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        ("other_process", {}),
    ],
)
def test_the_call_that_would_not_fit_is_blocked_and_the_one_that_fits_runs(tmp_path, how, env):
    r = run_child(tmp_path, how, **env)
    assert r["truth"] == "oom", r  # the scenario is real: the big forward does not fit
    assert r["big"] == "blocked", r
    assert r["predicted"] > r["free"] and r["free"] <= HEADROOM + GIB, r  # free_bytes: this process's, not the driver's
    first = r["message"].splitlines()
    assert "(oom mode: it would not fit)" in first[0]
    memory = next(line for line in first if line.strip().startswith("memory:"))
    assert "needs about" in memory and "this process can still get" in memory, memory
    assert r["small"] == "ran", r
