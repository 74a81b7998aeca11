"""The header written first in every log file (versions, host, argv redacted, ranks, what was
patched), and the rank a process runs as."""

from __future__ import annotations

import os
import socket
import sys
from typing import Optional

from fusionguard._version import __version__
from fusionguard.eventlog.distributed import process_group_ready
from fusionguard.eventlog.redact import redact_argv

SCHEMA_VERSION = 1


def rank_info() -> dict:
    """Rank, local rank and world size from torchrun's environment or torch.distributed."""

    def _int(name: str) -> Optional[int]:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            return None

    rank, world = _int("RANK"), _int("WORLD_SIZE")
    if rank is None and process_group_ready():
        try:
            import torch.distributed as dist  # lazy: torch loads on first use, never when this module is imported

            rank, world = dist.get_rank(), dist.get_world_size()
        except Exception:  # pragma: no cover - defensive
            pass
    return {"rank": rank if rank is not None else 0, "local_rank": _int("LOCAL_RANK"), "world_size": world or 1}


def header_fields(patched: list, not_patched: dict, config: dict) -> dict:
    """Versions and environment, written first in every log file."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    try:
        import triton  # type: ignore  # lazy: optional, and it imports torch

        triton_version = getattr(triton, "__version__", None)
    except Exception:
        triton_version = None
    cuda: dict = {"available": False}
    try:
        if torch.cuda.is_available():
            # device_count() does not create a CUDA context; names need one, so only when the
            # program already initialised CUDA (never grab memory on every rank's GPU 0).
            cuda = {"available": True, "count": torch.cuda.device_count(), "version": torch.version.cuda}
            if torch.cuda.is_initialized():
                cuda["devices"] = [torch.cuda.get_device_name(i) for i in range(cuda["count"])]
    except Exception:
        pass
    info = rank_info()
    return {
        "schema": SCHEMA_VERSION,
        "fusionguard": __version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "hostname": socket.gethostname(),
        "argv": redact_argv(sys.argv),
        "cuda": cuda,
        "local_rank": info["local_rank"],
        "world_size": info["world_size"],
        "patched": patched,
        "not_patched": not_patched,
        "config": config,
    }
