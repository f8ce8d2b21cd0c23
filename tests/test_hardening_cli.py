"""Issue 18, item 4: every bad command line prints one ``error: ...`` line and exits 2, never a traceback.

The store holds three passages embedded with the shipped MiniLM; the LLM is a tiny random model saved
to a folder (``--model``), so no row loads the embedded model. The bug each row catches is named in it.
"""

from __future__ import annotations

import pytest

from ctx_integrations.retrieval import DocumentStore
from tests.helpers import run_cli, tiny_loaded

PASSAGES = ["The vault code is 4721.", "The vault is in the cellar of the old mill.", "The mill has two wheels."]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    store = DocumentStore(root / "store")
    store.add([{"id": f"p{i}", "text": t} for i, t in enumerate(PASSAGES)], warm=False)
    loaded = tiny_loaded("llama")
    loaded.model.save_pretrained(root / "model")
    loaded.tokenizer.save_pretrained(root / "model")
    return root


CASES = {
    # lone surrogates: undecodable bytes in argv (the embedder's tokenizer raised a TypeError)
    "surrogate_question": ["ask", "vault code\udcff?"],
    "surrogate_mode": ["ask", "q?", "--mode", "pc\udcffed"],
    "surrogate_option": ["ask", "q?", "--option", "gamma=\udcff"],
    # NaN / inf / strings in --option (rapid eta=nan decoded garbage; a string tau crashed in a comparison)
    "gamma_nan": ["ask", "q?", "--option", "gamma=nan"],
    "eta_nan_rapid": ["ask", "q?", "--mode", "rapid", "--option", "eta=NaN"],
    "eta_inf_rapid": ["ask", "q?", "--mode", "rapid", "--option", "eta=Infinity"],
    "gamma_overflow": ["ask", "q?", "--option", "gamma=1e999"],
    "tau_string": ["ask", "q?", "--mode", "soft_nbce", "--option", 'tau="0.1"'],
    "beta_list": ["ask", "q?", "--option", "beta=[1]"],
    "summary_tokens_float": ["ask", "q?", "--mode", "map_reduce", "--option", "summary_tokens=1.5"],
    "option_no_key": ["ask", "q?", "--option", "=3"],
    "option_twice": ["ask", "q?", "--option", "gamma=1", "--option", "gamma=2"],
    "unknown_option": ["ask", "q?", "--option", "gama=1"],
    # settings torch rejected from inside (RuntimeError) or that decoded nothing
    "device_gpu": ["ask", "q?", "--device", "gpu"],
    "device_cuda_99": ["ask", "q?", "--device", "cuda:99"],
    "max_new_tokens_0": ["ask", "q?", "--max-new-tokens", "0"],
    "top_k_0": ["ask", "q?", "--top-k", "0"],
    "top_k_negative": ["ask", "q?", "--top-k", "-3"],
    "missing_model": ["ask", "q?", "--model", "/no/such/model/folder"],
    # an unreachable Chroma server (chromadb raised a ValueError)
    "unreachable_store": ["ask", "q?", "--store", "http://127.0.0.1:9"],
    "unreachable_store_ingest": ["ingest", "README.md", "--store", "http://127.0.0.1:9", "--no-cache"],
    "missing_store": ["ask", "q?", "--store", "{root}/nothing-here"],
    "store_is_a_file": ["ingest", "README.md", "--store", "README.md", "--no-cache"],
    "ingest_missing_path": ["ingest", "{root}/no-such-file.txt", "--store", "{root}/store2", "--no-cache"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_command_line_is_one_error_line_and_status_2(setup, capsys, name):
    argv = [arg.replace("{root}", str(setup)) for arg in CASES[name]]
    if argv[0] == "ask" and "--store" not in argv:
        argv += ["--store", str(setup / "store")]
    if argv[0] == "ask" and "--model" not in argv:
        argv += ["--model", str(setup / "model")]
    if argv[0] == "ask" and "--max-new-tokens" not in argv:
        argv += ["--max-new-tokens", "2"]
    status = run_cli(*argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: ")


def test_a_good_command_line_still_answers(setup, capsys):
    """The checks refuse bad input only: the same store and model answer a normal question."""
    status = run_cli("ask", "What is the vault code?", "--store", str(setup / "store"), "--model",
                     str(setup / "model"), "--max-new-tokens", "2", "--option", "gamma=2.5")
    assert status == 0, capsys.readouterr().err
