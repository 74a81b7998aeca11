"""A FLASH call's LSE on the dense path (#35).

PyTorch's top level rescales the LSE a FlexAttention call returns from log2 units unless the
call asked for ``kernel_options={"BACKEND": "FLASH"}`` (``stats_are_log2 = DEBUG or BACKEND !=
"FLASH"``: the CuTe DSL kernels return natural-log statistics). The dense kernel ignores
``BACKEND`` and always returns log2 units, so where a FLASH call runs dense (eager, a non-fusing
backend) the LSE it returns is 1/ln 2 = 1.4427x too large on some releases (torch 2.13 CPU: yes;
torch 2.11 CUDA: measured 1.000). Anything that merges LSEs (context parallel, attention sinks)
then silently computes wrong numbers.

Which releases: measured once per process, never from a list. Two tiny CPU calls of the public
``flex_attention`` with ``return_lse=True``, with and without ``BACKEND="FLASH"``, with the dense
guard stepping aside (``measuring()``); their ratio is the error. They run as any eager call
runs: PyTorch's top level compiles its one-line wrapper with Dynamo's ``eager`` backend (cache
limit off) and the dense kernel runs. Nothing process-wide changes meanwhile (an earlier version
used ``torch.compiler.set_stance("force_eager")``, which made every thread's compiled functions
run eagerly while it lasted). The calling program's own stance applies, as to its own calls.
The price: about 0.5 s once per process (two small Dynamo compiles, CPU), at the first dense
FLASH call that returns its LSE.
"""

from __future__ import annotations

import contextvars
import functools
import math
import warnings
from typing import Any, Optional

import torch

from fusionguard.dense.dynamo_signals import is_public_flex

_MEASURING: contextvars.ContextVar[bool] = contextvars.ContextVar("fusionguard_measuring_lse", default=False)


#: ``measuring()``: True while this module's own measurement runs, and the dense guard lets it
#: through unseen. The ContextVar's own ``get`` (read on every dense call: 22 ns, a function
#: around it 38 ns on the 2-core CPU machine).
measuring = _MEASURING.get


@functools.lru_cache(maxsize=1)
def flash_lse_scale() -> Optional[float]:
    """How many times too large this torch's dense path returns the LSE of a FLASH call (1.0:
    right), rounded to 4 places; None where it cannot be measured (an error: a ``fail_on_recompile``
    stance, say)."""
    from torch.nn.attention.flex_attention import flex_attention  # lazy: only for a FLASH call that runs dense

    token = _MEASURING.set(True)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, 16, 8, generator=g) for _ in range(3))
        with torch.no_grad(), warnings.catch_warnings():  # (no set_stance: it is process-wide)
            warnings.simplefilter("ignore")  # (PyTorch's own "called without torch.compile" warning)
            ref = flex_attention(q, k, v, return_lse=True)[1]
            got = flex_attention(q, k, v, return_lse=True, kernel_options={"BACKEND": "FLASH"})[1]
        return round(float((got / ref).mean()), 4)
    except Exception:
        return None
    finally:
        _MEASURING.reset(token)


def _returned(frame: Any, depth: int = 40) -> Optional[bool]:
    """Does the public ``flex_attention`` call on the stack return the LSE (``return_lse``, an
    ``AuxRequest(lse=True)``)? None when no such frame is there (a compiled graph's call)."""
    while frame is not None and depth:
        code = frame.f_code
        if is_public_flex(code.co_name, code.co_filename):
            local = frame.f_locals  # (that frame's tensors are the call's own, alive until it returns)
            aux = local.get("return_aux")
            return bool(local.get("return_lse")) or bool(getattr(aux, "lse", False))
        frame, depth = frame.f_back, depth - 1
    return None


def wrong_scale(kernel_options: Any, frame: Any) -> Optional[float]:
    """The factor by which a dense forward's LSE comes back too large, or None: only for
    ``BACKEND="FLASH"`` with the LSE computed, returned to the caller (or possibly: inside a
    compiled graph), where this torch gets it wrong (measured)."""
    if not isinstance(kernel_options, dict) or kernel_options.get("BACKEND") != "FLASH":
        return None
    if not kernel_options.get("OUTPUT_LOGSUMEXP", True) or _returned(frame) is False:
        return None
    scale = flash_lse_scale()
    return scale if scale is not None and not math.isclose(scale, 1.0, rel_tol=1e-3) else None


def message(scale: float) -> str:
    """The warning at the call (a ``RuntimeWarning``: wrong numbers, whether or not dense is allowed)."""
    return (
        f'fusionguard: this dense FlexAttention call has kernel_options BACKEND="FLASH" and its LSE comes back '
        f"{scale:.4f}x too large on torch {torch.__version__} (measured in this process): PyTorch rescales the "
        'LSE from log2 units unless BACKEND is "FLASH", and the dense kernel returns log2 units whatever the '
        "backend. Anything that merges LSEs (context parallel, attention sinks) gets wrong numbers. Multiply the "
        'LSE by ln 2 (0.6931), or leave BACKEND="FLASH" out where the call runs dense (torch 2.11 on CUDA measured '
        "1.000: not every release does this)."
    )
