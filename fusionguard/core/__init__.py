"""What every path shares: the options (``config``), the one runtime state (``state``) and the
tables it holds (``tables``), the undo registry (``registry``), and small helpers both the dense
and the fused path use (``frames``, ``tensors``, ``profiler``: ranges in ``torch.profiler``'s
timeline). The state holds the event log, so ``core/`` sits above ``eventlog/``; the layers are
the module map in docs/internals.md (tests/test_structure.py checks that this list names exactly
the folder's modules)."""
