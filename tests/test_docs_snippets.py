"""What the docs tell a user to run, run: the LlamaIndex reload snippet and the CLI's text about APE citations.

Bugs caught: docs/llama_index.md's "new process" snippet failed with ``ImportError:
llama-index-embeddings-openai`` because it did not set ``Settings.embed_model``; ``ctx-experts ask`` said
APE "has no per-token attribution" although APE records it with ``attribution=true`` (and the README
reports its citation precision).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the secret code of the vault?"


def python_block(document: Path, marker: str) -> str:
    """The fenced python block of ``document`` that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", document.read_text(encoding="utf-8"), re.DOTALL)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"{document.name} must have exactly one python block with {marker!r}"
    return found[0]


@pytest.mark.slow
def test_the_llama_index_reload_snippet_runs_in_a_new_process(tmp_path):
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode

    from ctx_integrations.llama_index import default_embedding

    # the first snippet's index, persisted here (the new process is the snippet's; cache reuse across
    # processes is tested in test_llama_index_patterns.py)
    index = VectorStoreIndex([TextNode(id_="vault", text="The secret code of the vault is 4721."),
                              TextNode(id_="paris", text="Paris is the capital of France.")],
                             embed_model=default_embedding())
    index.storage_context.persist(str(tmp_path / "storage"))
    snippet = python_block(ROOT / "docs" / "llama_index.md", "# reload.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CTX_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    env.pop("OPENAI_API_KEY", None)
    code = snippet + "\nimport json; print(json.dumps(response.metadata['cache']))\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cache = json.loads(done.stdout.strip().splitlines()[-1])
    assert cache["hits"] + cache["misses"] == 2  # both nodes reached the decoder as documents


def test_the_cli_says_how_to_get_ape_citations(capsys):
    from ctx_integrations import Engine
    from ctx_integrations.cli import _parse_options, _print_answer
    from tests.helpers import tiny_loaded

    engine = Engine(tiny_loaded("llama"))
    documents = ["The secret code of the vault is 4721.", "Paris is the capital of France."]
    # APE cites by default on the eager kernel; on flex (the CUDA default) it cannot, and the CLI says what to pass
    _print_answer(engine.generate(QUESTION, documents, mode="ape", max_new_tokens=2, attention_kernel="flex"))
    said = capsys.readouterr().out
    assert "has no per-token attribution" not in said and "--option attribution=true" in said
    options = _parse_options(["attribution=true"])  # what the text tells the user to pass works
    _print_answer(engine.generate(QUESTION, documents, mode="ape", max_new_tokens=2, attention_kernel="flex",
                                  **options))
    assert re.search(r"cited: \S+ \(r=[\d.]+, \d+ tokens\)", capsys.readouterr().out)
