"""Two engine replicas on Ray Serve (a local Ray cluster on 127.0.0.1), a shared KV folder, a Chroma server.

The replicas run the same tiny random-weight model as the in-process engine here, so every answer
through Ray must equal ``engine.generate`` token for token; and the cache-affinity router must send
every request for one set of documents to the same replica, while different sets use both.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve_support import chroma_server, free_port, sse_events, tiny_engine

pytestmark = pytest.mark.slow
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")

WORDS = "harbour bridge market winter tower library garden railway museum festival island treaty".split()


def _doc_sets(count: int) -> list[list[dict]]:
    return [[{"text": f"The {WORDS[i % 12]} of Velmora number {i} opened in {1900 + i}.", "id": f"a{i}"},
             {"text": f"Set {i}: the {WORDS[(i + 5) % 12]} closes at dusk in winter.", "id": f"b{i}"}]
            for i in range(count)]


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory):
    import ray

    from ctx_integrations.cli import load_demo_corpus
    from ctx_integrations.retrieval.store import DocumentStore
    from ctx_integrations.serve.ray_app import build_app, start

    data = tmp_path_factory.mktemp("ray")
    with chroma_server(data) as chroma_url:
        DocumentStore(chroma_url).add(load_demo_corpus()[0], warm=False)
        port = free_port()
        app = build_app(replicas=2, cache_dir=data / "kv", store_url=chroma_url,
                        engine_factory="tests.serve_support:tiny_engine")
        try:
            start(app, port=port, num_cpus=2)
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()


def test_two_replicas_answer_like_one_engine_with_document_affinity(ray_app):
    """Bugs caught: a router ignoring the documents (random replica per request, caches computed twice);
    replicas answering differently from the engine (a job field lost on the way through Ray)."""
    engine = tiny_engine()
    replica_of = {}
    for round_ in range(2):
        for i, docs in enumerate(_doc_sets(12)):
            body = {"query": f"When did number {i} open?", "documents": docs, "max_new_tokens": 3}
            answer = httpx.post(f"{ray_app}/v1/answer", json=body, timeout=120).json()
            assert answer["token_ids"] == engine.generate(body["query"], docs, max_new_tokens=3).token_ids
            if round_ == 0:
                replica_of[i] = answer["replica"]
            else:  # the same documents come back to the replica whose memory holds their caches
                assert answer["replica"] == replica_of[i]
                assert answer["cache"] == {**answer["cache"], "hits": 2, "misses": 0}
                if "hits_by_tier" in answer["cache"]:
                    assert answer["cache"]["hits_by_tier"].get("memory") == 2
    assert len(set(replica_of.values())) == 2, "every document set went to one replica"


def test_retrieval_from_the_chroma_server_streams_through_a_replica(ray_app):
    """Bug caught: the gateway not reaching the Chroma server, or streams not crossing the replica boundary."""
    body = {"query": "Who founded the city?", "top_k": 3, "max_new_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{ray_app}/v1/answer", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    answer = json.loads(events[-1][1])
    assert events[-1][0] == "answer" and "".join(json.loads(d)["text"] for _, d in events[:-1]) == answer["text"]
    assert len(answer["documents"]) == 3 and all("fused" in d["scores"] for d in answer["documents"])


def test_a_replica_error_is_a_4xx_naming_the_field(ray_app):
    """Bug caught: an error raised in a replica reaching the client as a 500 with Ray's remote trace."""
    response = httpx.post(f"{ray_app}/v1/answer", json={"query": "q", "documents": ["x"], "mode": "pced",
                                                        "options": {"gamma": -1}}, timeout=60)
    assert response.status_code == 422 and response.json()["error"]["param"] == "options"
    assert "Traceback" not in response.json()["error"]["message"]
