"""Collecting per-rank results on rank 0 through ``torch.distributed``.

Used by ``fusionguard.summary(all_ranks=True)`` and a session's ``ranks_with_dense()``. Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, List, Optional

__all__ = ["gather_to_rank0", "process_group_ready", "ranks_with"]


def process_group_ready() -> bool:
    """True when ``torch.distributed`` is available and a default process group is initialised."""
    try:
        import torch.distributed as dist  # lazy: torch loads on first use, never when this module is imported

        return bool(dist.is_available() and dist.is_initialized())
    except Exception:  # a torch build without distributed support
        return False


def gather_to_rank0(obj: Any, group: Any = None) -> Optional[List[Any]]:
    """Gather a picklable ``obj`` from every rank of ``group`` onto global rank 0.

    With a process group: a collective (every rank of the group must call it, like any other
    collective, or the callers block). Rank 0 gets the list of objects in rank order
    (``result[r]`` came from rank ``r``); the other ranks get ``None``. Uses
    ``torch.distributed.gather_object``: with NCCL the objects travel through the GPU given by
    ``torch.cuda.current_device()``, so each rank must have called ``torch.cuda.set_device``
    first (as for every NCCL object collective).

    Without a process group (a single process, or torchrun before ``init_process_group``):
    ``[obj]``, no communication.
    """
    if not process_group_ready():
        return [obj]
    import torch.distributed as dist  # lazy: torch loads on first use, never when this module is imported

    world = dist.get_world_size(group)
    rank = dist.get_rank()  # global rank: gather_object's dst is a global rank
    out: Optional[List[Any]] = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def ranks_with(flag: bool) -> List[int]:
    """The ranks whose ``flag`` is true, the same list on every rank: under a process group a
    collective every rank must call (one small all-reduce); one process: ``[0]`` or ``[]``."""
    if not process_group_ready():
        return [0] if flag else []
    import torch  # lazy: torch loads on first use, never when this module is imported
    import torch.distributed as dist  # lazy: as above

    nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[dist.get_rank()] = int(flag)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]
