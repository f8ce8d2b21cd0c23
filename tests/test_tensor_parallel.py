"""Tensor parallelism: a model split over two ranks (gloo, CPU, fp32) answers token for token as one process.

``Engine.from_pretrained(path, tensor_parallel=2)`` under ``torchrun --nproc-per-node 2`` loads the model with its
transformers tensor-parallel plan (each rank: half the heads of every layer, so half of every token's keys and
values in its rows and caches). Bugs caught: the row pool or the caches sized by the whole model's key/value heads
(a rank's keys then do not fit its rows), a rank's caches keyed like another rank's or the whole model's (they hold
other heads), ranks that sample different tokens, a split that silently did not happen.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ctx_integrations import Engine
from ctx_integrations.engine.core.model import _check_heads_split
from ctx_integrations.errors import InvalidOptionError
from tests.helpers import tiny_loaded
from tests.test_scheduler import DOCS

ROOT = Path(__file__).resolve().parents[1]
MODES = ["pced", "concat", "soft_nbce", "ape", "single"]
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from ctx_integrations import Engine
    path, docs, modes = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    engine = Engine.from_pretrained(path, dtype=torch.float32, tensor_parallel=dist.get_world_size())
    attention = engine.loaded.model.model.layers[0].self_attn
    local_kv_heads = attention.k_proj.weight.to_local().shape[0] // attention.head_dim
    answers = {mode: engine.generate("Who is the mayor of Marrowgate?", docs, mode=mode, max_new_tokens=8).token_ids
               for mode in modes}
    again = engine.generate("Who is the mayor of Marrowgate?", docs, mode="pced", max_new_tokens=8)  # from cache
    with open(f"rank{dist.get_rank()}.json", "w") as out:  # a file each: the ranks' stdout lines interleave
        json.dump({"rank": dist.get_rank(), "answers": answers, "again": again.token_ids,
                   "cache_hits": again.cache_hits, "name": engine.loaded.name,
                   "shards": engine.loaded.tensor_parallel, "local_kv_heads": local_kv_heads}, out)
    engine.close()
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    loaded = tiny_loaded("llama", seed=3)
    path = tmp_path_factory.mktemp("tiny-llama")
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path


def test_two_ranks_answer_token_for_token_as_one_process(model_dir, tmp_path):
    solo = Engine.from_pretrained(str(model_dir), dtype=torch.float32)
    expected = {mode: solo.generate("Who is the mayor of Marrowgate?", DOCS, mode=mode, max_new_tokens=8).token_ids
                for mode in MODES}
    solo.close()
    (tmp_path / "rank.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CTX_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), str(tmp_path / "rank.py"), str(model_dir), json.dumps(DOCS),
         json.dumps(MODES)], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["shards"] == 2 and result["local_kv_heads"] == 1  # the tiny model's 2 key/value heads, split
        assert result["answers"] == expected
        assert result["again"] == expected["pced"] and result["cache_hits"] > 0
    assert results[0]["name"] != results[1]["name"]  # each rank's caches are keyed by its own shard


def test_tensor_parallel_is_refused_outside_a_distributed_job_and_for_a_bad_size(model_dir):
    with pytest.raises(InvalidOptionError, match="torchrun --nproc-per-node 2"):
        Engine.from_pretrained(str(model_dir), tensor_parallel=2)
    for bad in (0, -1, True, 2.5, "2"):
        with pytest.raises(InvalidOptionError, match="tensor_parallel must be a whole number"):
            Engine.from_pretrained(str(model_dir), tensor_parallel=bad)


def test_heads_that_do_not_split_over_the_ranks_are_refused():
    model = tiny_loaded("llama", seed=3).model  # 4 attention heads, 2 key/value heads
    _check_heads_split(model, "tiny", 2)
    with pytest.raises(InvalidOptionError, match="do not split over 4 ranks"):
        _check_heads_split(model, "tiny", 4)
