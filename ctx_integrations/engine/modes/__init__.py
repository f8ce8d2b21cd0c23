"""The decoding methods, one module each: which streams a mode needs and its per-step rule.

``pced`` (PCED), ``soft_nbce`` (Soft-NBCE, hard NBCE, PCW), ``ape`` (APE), ``rapid`` (RAPID, with the
speculative math in ``speculative``), ``ippd`` (IPPD) and ``baselines`` (concat, single, map_reduce).
Importing a module registers its modes with :mod:`ctx_integrations.engine.core.registry`.
"""
