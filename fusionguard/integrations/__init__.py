"""Framework integrations, each imported only when used (``import fusionguard`` imports none):

- ``fusionguard.integrations.transformers``: ``FusionGuardCallback`` for the Hugging Face ``Trainer``
  (extra ``fusionguard[transformers]``);
- ``fusionguard.integrations.lightning``: ``FusionGuardCallback`` for ``lightning``,
  ``PLFusionGuardCallback`` for ``pytorch_lightning`` (extra ``fusionguard[lightning]``).

docs/integrations.md shows a copy-paste block per framework, torchtitan included.
"""
