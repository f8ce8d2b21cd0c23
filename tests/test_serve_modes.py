"""``GET /v1/modes`` lists every mode from its declaration, and a request's options are checked against it at the
edge: before retrieval and before the backend (a Ray replica, a model) sees the job. In-process, no model."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from ctx_integrations import available_modes, mode_spec  # noqa: E402
from ctx_integrations.serve.app import create_app  # noqa: E402
from tests.serve_support import CannedBackend  # noqa: E402


class RecordingBackend(CannedBackend):
    async def batch(self, job: dict) -> list[dict]:
        self.jobs.append(job)
        return await super().batch(job)


def _send(method: str, path: str, body: dict | None = None) -> tuple[httpx.Response, RecordingBackend]:
    backend = RecordingBackend()

    async def send() -> httpx.Response:
        app = create_app(backend=backend, model_name="fake")  # no store: retrieval would be refused by name
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(send()), backend


def test_modes_lists_every_declared_mode_with_its_options_and_paper():
    response, _ = _send("GET", "/v1/modes")
    assert response.status_code == 200, response.text
    listed = response.json()
    assert listed["object"] == "list"
    assert [mode["name"] for mode in listed["data"]] == available_modes()
    assert listed["data"] == [mode_spec(name).describe() for name in available_modes()]
    pced = listed["data"][available_modes().index("pced")]
    assert "Parallel Context-of-Experts Decoding" in pced["paper"] and pced["answers_many"] is False
    gamma = next(option for option in pced["options"] if option["name"] == "gamma")
    assert {k: gamma[k] for k in ("type", "default", "minimum", "maximum", "origin", "expects")} == {
        "type": "float", "default": 5.0, "minimum": 0.0, "maximum": 100.0, "origin": "paper",
        "expects": "a number in [0, 100]"}
    switch = next(option for option in pced["options"] if option["name"] == "switch")
    assert switch["choices"] == ["token", "word"] and switch["origin"] == "variant" and switch["help"]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/answer", {"query": "q", "top_k": 2, "mode": "pced", "options": {"gamma": "abc"}},
     "mode 'pced': option gamma must be a number in [0, 100], got 'abc'"),
    ("/v1/answer", {"query": "q", "top_k": 2, "stream": True, "mode": "pced", "options": {"gamma": 101}},
     "mode 'pced': option gamma must be a number in [0, 100], got 101"),
    ("/v1/answer", {"query": "q", "documents": ["d"], "mode": "rapid", "options": {"gamma": 2.5}},
     "mode 'rapid': option gamma must be an integer >= 1, got 2.5"),
    ("/v1/answer/batch", {"queries": ["q", "r"], "documents": ["d"], "options": {"max_stack_tokens": 0}},
     "mode 'ippd': option max_stack_tokens must be an integer >= 1, or None, got 0"),
    ("/v1/chat/completions", {**CHAT, "ctx": {"top_k": 2, "mode": "pced", "options": {"switch": "words"}}},
     "mode 'pced': option switch must be one of 'token', 'word', got 'words'"),
    ("/v1/chat/completions", {**CHAT, "ctx": {"top_k": 2, "mode": "pced", "options": {"gama": 1}}},
     "mode 'pced' does not accept gama; its options are: aggregation, beta, gamma, prior, prior_floor, prior_tau, "
     "query_likelihood, score_space, switch (did you mean gamma?)"),
])
def test_a_bad_option_is_refused_at_the_edge_before_retrieval_and_the_backend(path, body, message):
    """Bug caught: the option reaching the engine (a replica) first, or retrieval running for a request that is
    refused anyway (these servers have no store: without the edge check the error would name the store)."""
    response, backend = _send("POST", path, body)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == {"message": message, "type": "invalid_request_error", "param": "options",
                                        "code": 422}
    assert backend.jobs == []


def test_good_options_reach_the_backend_unchanged():
    options = {"gamma": 2, "switch": "word", "beta": None}
    response, backend = _send("POST", "/v1/answer", {"query": "q", "documents": ["d"], "mode": "pced",
                                                     "options": options})
    assert response.status_code == 200, response.text
    assert [job["options"] for job in backend.jobs] == [options]
