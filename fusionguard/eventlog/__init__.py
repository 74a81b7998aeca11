"""The event log: the structlog pipeline (``log``), its header and argv redaction (``header``,
``redact``), the file and its durability (``sink``), bounded volume (``sampler``), the event kinds
(``kinds``), the human messages (``messages``), the words every output shares (``formatting``),
rank helpers (``distributed``) and the crash hooks (``crash``, ``diagnosis``)."""
