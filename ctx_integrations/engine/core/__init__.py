"""The serving core: model loading, prompt layout, KV caches, batched streams, the engine and its mode registry.

Nothing here knows a decoding method by name; the methods live in ``ctx_integrations.engine.modes``
and register themselves with :mod:`ctx_integrations.engine.core.registry`.
"""
