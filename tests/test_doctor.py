"""`fusionguard doctor` on CPU: inference only, eager dense vs compiled fused, exit status.

``python -m fusionguard doctor`` forked from tests/forkserver.py (torch imported, no fusionguard):
what the doctor checks is the stack, not the interpreter's start."""

from __future__ import annotations

import subprocess
import sys

import forkserver
import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_doctor_on_cpu_says_fused_ok():
    proc = forkserver.run(
        [sys.executable, "-m", "fusionguard", "doctor", "--shape", "1,4,2,64,64,8", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # a progress line per experiment, as it starts (stderr), so a 30 s CPU run is never silent
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("fusionguard doctor: [")]
    assert [ln.split("]")[0][-3:] for ln in progress] == ["1/4", "2/4", "3/4", "4/4"], proc.stderr[-2000:]
    assert "compiled no mask GQA (compiling)" in progress[1]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "FUSED - OK"
    assert any("torch 2." in ln for ln in lines[:3])
    eager = [ln for ln in lines if ln.strip().startswith("eager")]
    compiled = [ln for ln in lines if ln.strip().startswith("compiled")]
    assert len(eager) == len(compiled) == 2
    assert all("dense (eager_call)" in ln for ln in eager)
    assert all("fused (cpp)" in ln for ln in compiled)


@pytest.mark.parametrize("shape", ["1,2,3", "1,3,2,64,64,8", "a,b,c,d,e,f"])
def test_doctor_rejects_bad_shapes(shape):
    proc = forkserver.run(
        [sys.executable, "-m", "fusionguard", "doctor", "--shape", shape], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 2 and ("--shape" in proc.stderr or "GQA" in proc.stderr)


def test_doctor_fails_clearly_on_a_non_fusing_stack():
    proc = forkserver.run(
        [sys.executable, "-m", "fusionguard", "doctor", "--shape", "1,4,2,64,64,8", "--device", "cpu", "--backend", "aot_eager"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("DENSE")
    assert "ran DENSE (cause: non_inductor_backend)" in proc.stdout


@pytest.mark.parametrize(
    "args, said",
    [
        (["--device", "tpu"], "--device 'tpu' is not a device torch knows"),
        (["--device", "cuda"], "no CUDA device is available here"),
        (["--backend", "nonsense"], "--backend 'nonsense' is not a torch.compile backend here"),
    ],
)
def test_doctor_refuses_bad_options_cleanly(args, said):
    """Exit 2 (usage), one line on stderr, no traceback, nothing run."""
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a CUDA device is available: --device cuda is a good option here")
    proc = forkserver.run([sys.executable, "-m", "fusionguard", "doctor", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert said in proc.stderr and "Traceback" not in proc.stderr and proc.stdout == ""


def test_version_flag():
    from fusionguard import __version__

    proc = subprocess.run([sys.executable, "-m", "fusionguard", "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == f"fusionguard {__version__}"
