"""The dense path: the guard around ``sdpa_dense`` / ``sdpa_dense_backward`` (``guard``), why a
call ran dense (``causes``, ``dynamo_signals``), recompile pressure (``pressure``), eager mask
builds (``masks``), memory predictions (``memory``), a FLASH call's LSE units on the dense path
(``lse``) and ``rescue=True`` (``rescue``)."""
