"""What every path shares: the options (``config``), the one runtime state (``state``) and the
tables it holds, the undo registry (``registry``), and small helpers both the dense and the fused
path use (``frames``, ``tensors``, ``formatting``, ``distributed``). The state holds the event log
and Dynamo's signals, so ``state`` sits above ``eventlog/``; the import order is the module map in
docs/internals.md."""
