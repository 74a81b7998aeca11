"""The two exception types a user may see from fusionguard."""

from __future__ import annotations

__all__ = ["DenseFallbackError", "DenseFallbackWarning"]


class DenseFallbackError(RuntimeError):
    """Raised in strict mode *before* FlexAttention's dense kernel allocates.

    ``event`` holds the logged event (a dict) so a caller can inspect the verdict
    programmatically: ``err.event["cause"]``, ``err.event["scores_bytes"]``...
    """

    def __init__(self, message: str, event: dict | None = None) -> None:
        super().__init__(message)
        self.event = event or {}


class DenseFallbackWarning(UserWarning):
    """Issued in warn mode for a dense FlexAttention execution.

    A ``UserWarning`` subclass, so the standard filters apply, e.g.
    ``warnings.simplefilter("always", fusionguard.DenseFallbackWarning)``.
    """
