"""The PCED paper's synthetic latency set for the benchmarks: N documents of exactly L tokens, one holds a
secret code. The generator is the package's (``ctx_integrations.evaluation.sets.secret_code_documents``,
also behind ``ctx-experts eval --set secret_code``); this module only gives it the shape the benchmarks use.
"""

from __future__ import annotations

from dataclasses import dataclass

from ctx_integrations.engine.core.layout import PromptLayout
from ctx_integrations.evaluation.sets import SECRET_CODE_QUESTION, secret_code_documents

QUESTION = SECRET_CODE_QUESTION


@dataclass
class SecretCodeExample:
    documents: list[str]
    needle_index: int
    code: str
    question: str = QUESTION

    @property
    def answers(self) -> list[str]:
        return [self.code]


def secret_code_example(layout: PromptLayout, n_documents: int, length: int, seed: int = 0) -> SecretCodeExample:
    return SecretCodeExample(*secret_code_documents(layout, n_documents, length, seed=seed))
