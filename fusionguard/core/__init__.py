"""What every path shares: the options (``config``), the one runtime state (``state``) and the
tables it holds, the undo registry (``registry``), and small helpers both the dense and the fused
path use (``frames``, ``tensors``, ``formatting``, ``distributed``). Nothing here imports the
pipelines above it."""
