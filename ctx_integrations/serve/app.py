"""The HTTP API: FastAPI routes over a :class:`~ctx_integrations.serve.backend.Backend`.

``create_app(engine, store)`` serves one engine in this process; ``ray_app`` passes a backend that
forwards jobs to Ray Serve replicas. This layer bounds what a request may ask (:class:`ServerLimits`:
header size, body size and read deadline in middlewares, field sizes in the schemas), checks
the API key (:mod:`~ctx_integrations.serve.auth`), validates requests (pydantic, strictly typed, parsed on a
worker thread so the event loop only moves bytes; OpenAI fields the server does not implement are
refused by name, :mod:`~ctx_integrations.serve.unsupported`), retrieves documents from the store
with every score, admits or refuses work (``max_in_flight`` -> 503 + Retry-After, like the engine's
own ``EngineOverloadedError``), streams server-sent events, cancels work whose client went away,
counts everything for ``/metrics`` and logs one line per request
(:mod:`~ctx_integrations.serve.access_log`). FastAPI, Starlette and uvicorn do the HTTP; what is
written here is only the mapping from HTTP to the engine's async API.

The routes are module-level functions on :data:`router`; the state of one app (its backend, store,
limits, served model names, metrics) is a :class:`ServerState` in ``app.state.server``, which each
route receives as a dependency. Every error, whatever raised it (a route, pydantic, an unknown
route or method, a bug), is answered in OpenAI's error shape (:data:`_HANDLERS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from ctx_integrations import DEFAULT_BATCH_MODE, DEFAULT_MODE, check_mode, describe_modes
from ctx_integrations.errors import CtxIntegrationsError, EngineOverloadedError, InvalidOptionError
from ctx_integrations.serve.access_log import CLIENT_CLOSED, AccessLogMiddleware
from ctx_integrations.serve.auth import ApiKeyMiddleware, api_keys
from ctx_integrations.serve.backend import Backend, LocalBackend
from ctx_integrations.serve.encoding import SafeJSONResponse, sse
from ctx_integrations.serve.errors import ModelNotServedError, error_body, headers_of, status_of, validation_error
from ctx_integrations.serve.limits import BodyLimitMiddleware, HeaderLimitMiddleware, ServerLimits
from ctx_integrations.serve.metrics import ServerMetrics
from ctx_integrations.serve.model_names import model_id, served_model_names
from ctx_integrations.serve.schemas import AnswerRequest, BatchRequest, ChatCompletionRequest, to_documents

Body = TypeVar("Body", bound=BaseModel)

_DISCONNECT_POLL_S = 0.05


class RequestFieldError(InvalidOptionError):
    """A request that is well-formed but cannot be served as asked (e.g. top_k on a server without a store)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class RequestClosed(Exception):
    """The client disconnected before its answer was ready; the work was cancelled."""


class CancellingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always closes its body iterator, so a disconnect cancels the request.

    With ASGI spec 2.4 Starlette notices a disconnect only when a send fails, and then leaves the
    body generator suspended for the garbage collector; closing it here runs its ``finally`` now,
    which closes the engine's stream and frees the request's rows.
    """

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


class InvalidBody(Exception):
    """A request body pydantic refused (malformed JSON, a wrong type, a size limit); rendered by the app."""

    def __init__(self, error: ValidationError):
        super().__init__(str(error))
        self.problems = error.errors(include_input=False, include_url=False)


_BODIES: tuple[type[BaseModel], ...] = (AnswerRequest, BatchRequest, ChatCompletionRequest)


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for a body the route parses itself (FastAPI documents only the bodies it parses)."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _with_body_schemas(app: FastAPI) -> Callable[[], dict[str, Any]]:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            _, definitions = models_json_schema([(m, "validation") for m in _BODIES],
                                                ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def _validate(model: type[Body], raw: bytes, limits: ServerLimits) -> Body:
    if not raw:
        raise RequestFieldError("body", "the request has no body: send a JSON object (Content-Type: application/json)")
    try:
        return model.model_validate_json(raw, strict=True, context={"limits": limits})
    except ValidationError as error:
        raise InvalidBody(error) from None


class ServerState:
    """State of one app: the backend, the optional store and retriever, the admission limit, the served model
    names, the metrics. Routes receive it as a dependency (:func:`server_state`)."""

    def __init__(self, backend: Backend, store: Any, retriever: Any, max_in_flight: int | None,
                 model_names: tuple[str, ...], root: str, limits: ServerLimits):
        if max_in_flight is not None and max_in_flight < 1:
            raise InvalidOptionError("max_in_flight must be >= 1 (or None for no limit)")
        self.backend, self.store, self.max_in_flight = backend, store, max_in_flight
        self.model_names, self.root = model_names, root
        self.limits, self.created = limits, int(time.time())
        if retriever is None and store is not None:
            from ctx_integrations.retrieval.retriever import ScoredRetriever

            retriever = ScoredRetriever(store)
        self.retriever = retriever
        self.metrics = ServerMetrics(self._stats)
        self.in_flight = 0

    @property
    def model_name(self) -> str:
        """The name the server reports (the first served name)."""
        return self.model_names[0]

    def served_model(self, requested: str | None) -> str:
        """The name to answer with: ``requested`` when the server serves it (the first name when none was named)."""
        if requested is None:
            return self.model_name
        if requested not in self.model_names:
            raise ModelNotServedError(requested, self.model_names)
        return requested

    def model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "ctx-integrations",
                "root": self.root}

    def _stats(self) -> dict[str, Any]:
        try:
            return self.backend.stats()
        except Exception:  # a scrape must not fail because a replica is busy or gone
            return {}

    # -- admission -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def admitted(self) -> Any:
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            raise EngineOverloadedError(f"the server already has {self.in_flight} requests in flight (limit "
                                        f"{self.max_in_flight}, --max-in-flight): retry after the Retry-After delay")
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()

    # -- request bodies --------------------------------------------------------------------------------
    async def parse(self, request: Request, model: type[Body]) -> Body:
        """The body as ``model``: parsed and validated on a worker thread (JSON of any size never blocks the loop).

        pydantic's JSON parser refuses what ``json.loads`` lets through: bytes that are not UTF-8
        (a UTF-16 body), lone surrogates (``"\\ud800"``), and, with ``strict``, ``"5"`` for an int.
        """
        raw = await request.body()  # already read, within the size limit and deadline, by BodyLimitMiddleware
        return await asyncio.to_thread(_validate, model, raw, self.limits)

    # -- documents -------------------------------------------------------------------------------------
    async def retrieve(self, query: str, top_k: int, field: str = "top_k") -> list[dict[str, Any]]:
        if self.retriever is None:
            raise RequestFieldError(field, f"{field} asks for retrieval but this server has no store: send "
                                    "documents inline, or start it with `ctx-experts serve --store DIR`")
        docs = await asyncio.to_thread(self.retriever.retrieve, query, top_k)
        return [d.to_dict() for d in docs]

    async def documents_for(self, query: str, documents: list[Any] | None, top_k: int | None) -> list[dict[str, Any]]:
        if documents is not None:
            return await asyncio.to_thread(lambda: [d.to_dict() for d in to_documents(documents)])
        if top_k is None and self.retriever is None:
            raise RequestFieldError("documents", "no documents: send them inline (documents), or start the "
                                    "server with --store DIR and send top_k to retrieve them")
        return await self.retrieve(query, top_k or 4)

    # -- running work ----------------------------------------------------------------------------------
    async def until_disconnect(self, request: Request, work: Awaitable[Any]) -> Any:
        """Await ``work``; if the client disconnects first, cancel it (the engine frees the request)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise RequestClosed()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def answered(self, endpoint: str, request: Request, work: Callable[[], Awaitable[Any]]) -> Any:
        """Run one non-streaming request: admission, cancellation on disconnect, metrics."""
        started = time.perf_counter()
        outcome = "error"
        try:
            with self.admitted():
                self.metrics.waiting.inc()
                try:
                    result = await self.until_disconnect(request, work())
                finally:
                    self.metrics.waiting.dec()
            outcome = "ok"
            return result
        except RequestClosed:
            outcome = "cancelled"
            return Response(status_code=CLIENT_CLOSED)
        except EngineOverloadedError:
            outcome = "overloaded"
            raise
        finally:
            self.metrics.requests.labels(endpoint, outcome).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    async def streamed(self, endpoint: str, request: Request, job: dict[str, Any],
                       render: Callable[[dict[str, Any]], list[str]], closing: list[str]) -> Response:
        """Open a stream; errors before the first event become normal 4xx/5xx responses, later ones an SSE event."""
        started = time.perf_counter()
        admission = self.admitted()
        try:
            admission.__enter__()
        except EngineOverloadedError:
            self.metrics.requests.labels(endpoint, "overloaded").inc()
            raise
        events = self.backend.stream(job)
        self.metrics.waiting.inc()
        try:
            first = await self.until_disconnect(request, events.__anext__())
        except BaseException as error:
            await events.aclose()
            outcome = {EngineOverloadedError: "overloaded", RequestClosed: "cancelled"}.get(type(error), "error")
            self.metrics.requests.labels(endpoint, outcome).inc()
            admission.__exit__(None, None, None)
            if isinstance(error, RequestClosed):
                return Response(status_code=CLIENT_CLOSED)
            raise
        finally:
            self.metrics.waiting.dec()
        self.metrics.active_streams.inc()

        async def body() -> AsyncIterator[str]:
            outcome = "cancelled"
            try:
                event: dict[str, Any] | None = first
                while event is not None:
                    if "answer" in event:
                        self.metrics.observe_answer(event["answer"])
                    for chunk in render(event):
                        yield chunk
                    event = await anext(events, None)
                for chunk in closing:
                    yield chunk
                outcome = "ok"
            except CtxIntegrationsError as error:
                outcome = "error"
                yield sse(_library_error_body(error)[1], "error")
            except Exception as error:  # a bug, not the client's mistake: say so in the stream instead of cutting it
                outcome = "error"
                yield sse(error_body(_internal_message(error), 500), "error")
            finally:
                await events.aclose()
                self.metrics.active_streams.dec()
                self.metrics.requests.labels(endpoint, outcome).inc()
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
                admission.__exit__(None, None, None)

        return CancellingStreamingResponse(body(), media_type="text/event-stream; charset=utf-8",
                                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _engine_job(query: str, documents: list[dict[str, Any]], mode: str, options: dict[str, Any],
                sampling: Any) -> dict[str, Any]:
    return {"query": query, "documents": documents, "mode": mode, "options": dict(options),
            "sampling": sampling.sampling_fields(), "timeout": sampling.timeout}


def _held_to_a_format(job: dict[str, Any]) -> bool:
    """Whether the job's answer is held to a format it must complete: a ``response_format``, or a tool call the
    model must make (``tool_choice`` ``required`` or a tool's name)."""
    return bool(job.get("sampling", {}).get("structured")) or job.get("tool_choice") not in (None, "auto")


def _finish_reason(answer: dict[str, Any], held: bool = False) -> str:
    """OpenAI's ``finish_reason`` of an answer (the engine's is ``eos``, ``stop`` or ``length``).

    ``length`` for an answer cut short, calls or not (OpenAI's rule), and, ``held`` (:func:`_held_to_a_format`),
    for one that did not reach its format's end: a stop string cuts a JSON answer (``{"name": "Aurora"``) as
    surely as ``max_tokens`` does, and ``length`` is what OpenAI's clients take for an incomplete structured
    answer (``parse`` raises ``LengthFinishReasonError``), where ``stop`` says it is complete. The engine's own
    reason stays in ``ctx.finish_reason``, as ``/v1/answer``, the engine and the adapters report it (a
    structured answer is complete only at ``eos``)."""
    reason = answer.get("finish_reason")
    if reason == "length" or (held and reason != "eos"):
        return "length"
    return "tool_calls" if answer.get("tool_calls") else "stop"


def _tool_calls(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's tool calls in OpenAI's shape (arguments as JSON text), then the call ``max_tokens`` cut, if any,
    as OpenAI answers one: an entry whose ``arguments`` are the text as far as written (not valid JSON), with
    ``finish_reason="length"``. Why: its markup never reaches ``content``, and a client that iterates
    ``tool_calls`` and checks ``finish_reason`` (as for OpenAI) sees the cut instead of a call-less prose answer."""
    calls = [{"id": call["id"], "type": "function",
              "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
             for call in answer.get("tool_calls") or []]
    cut = answer.get("cut_tool_call")
    if cut:
        calls.append({"id": cut["id"], "type": "function",
                      "function": {"name": cut["name"], "arguments": cut["arguments"]}})
    return calls


def _message(answer: dict[str, Any]) -> dict[str, Any]:
    """The assistant's message: its text (``null`` when it only called tools) and its tool calls."""
    calls = _tool_calls(answer)
    if not calls:
        return {"role": "assistant", "content": answer["text"]}
    return {"role": "assistant", "content": answer["text"] or None, "tool_calls": calls}


def _logprobs(answer: dict[str, Any]) -> dict[str, Any] | None:
    return {"content": answer["logprobs"]} if "logprobs" in answer else None


def _usage(answer: dict[str, Any]) -> dict[str, int]:
    prompt = int(answer.get("timings", {}).get("prompt_tokens", 0))
    completion = len(answer.get("token_ids", []))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _answer_events(event: dict[str, Any]) -> list[str]:
    if "token" in event:
        return [sse({"text": event["token"]}, "token")]
    return [sse(event["answer"], "answer")]


# -- routes ------------------------------------------------------------------------------------------------
router = APIRouter()


def server_state(request: Request) -> ServerState:
    """The app's :class:`ServerState` (set by :func:`create_app`)."""
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]


@router.get("/healthz")
@router.get("/health")
async def healthz(server: State) -> dict[str, Any]:
    return {"status": "ok", "model": server.model_name, "served_model_names": list(server.model_names),
            "in_flight": server.in_flight, "store": None if server.store is None else str(server.store.location)}


@router.get("/metrics")
async def metrics(server: State) -> Response:
    return Response(server.metrics.render(), media_type=server.metrics.content_type)


@router.get("/v1/models")
async def models(server: State) -> dict[str, Any]:
    """OpenAI's model list, one card per served name (LangChain's and LlamaIndex's clients list models first)."""
    return {"object": "list", "data": [server.model_card(name) for name in server.model_names]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, server: State) -> dict[str, Any]:
    return server.model_card(server.served_model(model_id))


@router.get("/v1/modes")
async def modes() -> dict[str, Any]:
    """Every decoding mode this server answers with, from its declaration: its summary, the paper it implements and
    each option's type, default, range or choices, help and origin (the paper's knob or our variant); and under
    "unavailable" each mode an installed package declares whose entry point failed to load, with the reason."""
    return describe_modes()


@router.post("/v1/answer", response_model=None, openapi_extra=_body_doc(AnswerRequest))
async def answer(request: Request, server: State) -> Any:
    body = await server.parse(request, AnswerRequest)
    check_mode(body.mode, body.options)  # at the edge: before retrieval, and before a backend (a Ray replica) sees it
    documents = await server.documents_for(body.query, body.documents, body.top_k)
    job = _engine_job(body.query, documents, body.mode, body.options, body)
    if body.stream:
        return await server.streamed("answer", request, job, _answer_events, [])

    async def work() -> dict[str, Any]:
        result = await server.backend.answer(job)
        server.metrics.observe_answer(result)
        return result

    return await server.answered("answer", request, work)


@router.post("/v1/answer/batch", response_model=None, openapi_extra=_body_doc(BatchRequest))
async def batch(request: Request, server: State) -> Any:
    body = await server.parse(request, BatchRequest)
    if body.documents is not None:
        shared: list[dict[str, Any]] | None = await server.documents_for(body.queries[0], body.documents, None)
        documents: Any = shared
    else:
        per_query = await asyncio.gather(*(server.documents_for(q, None, body.top_k) for q in body.queries))
        ids = {tuple(d["id"] for d in docs) for docs in per_query}
        shared = per_query[0] if len(ids) == 1 else None
        documents = shared if shared is not None else list(per_query)
    mode = body.mode or (DEFAULT_BATCH_MODE if shared is not None else DEFAULT_MODE)
    check_mode(mode, body.options)
    job = {"queries": list(body.queries), "documents": documents, "mode": mode, "options": dict(body.options),
           "sampling": body.sampling_fields(), "timeout": body.timeout}

    async def work() -> dict[str, Any]:
        answers = await server.backend.batch(job)
        for item in answers:
            server.metrics.observe_answer(item)
        return {"mode": mode, "shared_documents": shared is not None, "answers": answers}

    return await server.answered("batch", request, work)


async def _chat_job(server: ServerState, body: ChatCompletionRequest) -> dict[str, Any]:
    """The engine job of a chat request: the conversation as is, or (``ctx``) the last user message over the store."""
    sampling = body.sampling()
    if body.ctx is None or not body.ctx.store:
        return {"messages": body.conversation(), "sampling": sampling.sampling_fields(), "timeout": None,
                **body.tool_fields()}
    check_mode(body.ctx.mode, body.ctx.options)
    try:
        query = body.last_user_message()
    except ValueError as error:
        raise RequestFieldError("messages", f"{error}: a retrieval-augmented chat answers the last "
                                "user message") from None
    documents = await server.retrieve(query, body.ctx.top_k, field="ctx.store")
    return _engine_job(query, documents, body.ctx.mode, body.ctx.options, sampling)


def _chat_chunks(completion_id: str, created: int, model_name: str, include_usage: bool,
                 held: bool = False, with_ctx: bool = False) -> Callable[[dict[str, Any]], list[str]]:
    """The SSE renderer of a streamed chat: one ``chat.completion.chunk`` per token, then the finish chunk
    (its ``finish_reason`` that of the whole answer, :func:`_finish_reason` with ``held``).

    The finish chunk carries ``usage`` unless the client asked for ``stream_options.include_usage``: then usage
    comes in OpenAI's extra last chunk (no choices), and only there, so clients that add up the usage of every
    chunk count it once; and the whole answer in ``ctx`` when the request sent ``ctx`` (:func:`_answer_extra`).
    """
    def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
        return sse({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": choices, **(extra or {})})

    def render(event: dict[str, Any]) -> list[str]:
        if "token" in event:
            return [chunk([{"index": 0, "delta": {"content": event["token"]}, "finish_reason": None}])]
        answer = event["answer"]
        calls = [{"index": index, **call} for index, call in enumerate(_tool_calls(answer))]
        finish = [{"index": 0, "delta": {"tool_calls": calls} if calls else {},
                   "finish_reason": _finish_reason(answer, held), "logprobs": _logprobs(answer)}]
        if include_usage:
            return [chunk(finish, {"usage": None, **_answer_extra(answer, with_ctx)}),
                    chunk([], {"usage": _usage(answer)})]
        return [chunk(finish, {"usage": _usage(answer), **_answer_extra(answer, with_ctx)})]

    return render


def _answer_extra(answer: dict[str, Any], asked: bool) -> dict[str, Any]:
    """``{"ctx": answer}`` (the whole Answer: per-token trace, documents, timings) for a request that sent the
    extension field ``ctx`` (``{"ctx": {"store": false}}`` asks for it on a plain chat), else nothing: an OpenAI
    client that asked for none gets no per-token trace (~100 bytes a token) in every reply."""
    return {"ctx": answer} if asked else {}


@router.post("/v1/chat/completions", response_model=None, openapi_extra=_body_doc(ChatCompletionRequest))
async def chat(request: Request, server: State) -> Any:
    body = await server.parse(request, ChatCompletionRequest)
    model_name = server.served_model(body.model)
    job = await _chat_job(server, body)
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        render = _chat_chunks(completion_id, created, model_name, include_usage, _held_to_a_format(job),
                              with_ctx=body.ctx is not None)
        return await server.streamed("chat", request, job, render, [sse("[DONE]")])

    async def work() -> dict[str, Any]:
        answer = await server.backend.answer(job)
        server.metrics.observe_answer(answer)
        return {"id": completion_id, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": _message(answer),
                             "finish_reason": _finish_reason(answer, _held_to_a_format(job)),
                             "logprobs": _logprobs(answer)}],
                "usage": _usage(answer), **_answer_extra(answer, body.ctx is not None)}

    return await server.answered("chat", request, work)


# -- errors: every status in OpenAI's shape ----------------------------------------------------------------
# the engine's names of sampling settings whose request field is spelled otherwise
_REQUEST_FIELDS = {"structured": "response_format", "top_k": "top_k"}

def _library_error_body(error: CtxIntegrationsError) -> tuple[int, dict[str, Any]]:
    status, param = status_of(error)
    field = getattr(error, "field", None)
    param = _REQUEST_FIELDS.get(field, field) or param
    return status, error_body(str(error), status, param, getattr(error, "openai_code", None))


def _internal_message(error: BaseException) -> str:
    return f"internal error ({type(error).__name__}): the server's log has the details"


async def _library_error(_: Request, error: CtxIntegrationsError) -> Response:
    status, body = _library_error_body(error)
    return SafeJSONResponse(body, status_code=status, headers=headers_of(status))


async def _invalid_body(_: Request, error: InvalidBody) -> Response:
    status, body = validation_error(error.problems)
    return SafeJSONResponse(body, status_code=status)


async def _invalid_request(_: Request, error: RequestValidationError) -> Response:
    status, body = validation_error(error.errors())
    return SafeJSONResponse(body, status_code=status)


async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
    """Starlette's own refusals: 404 for a path no route serves, 405 for a method the route does not take."""
    status, method, path = error.status_code, request.method, request.url.path[:200]
    headers = dict(error.headers or {})
    if status == 404:
        message = (f"no route for {method} {path}: this server serves /v1/chat/completions, /v1/models, /v1/modes, "
                   "/v1/answer, /v1/answer/batch, /healthz and /metrics")
    elif status == 405:
        message = f"{method} is not allowed on {path}: use {headers.get('Allow', 'another method')}"
    else:
        message = str(error.detail)
    return SafeJSONResponse(error_body(message, status), status_code=status, headers=headers)


async def _internal_error(_: Request, error: Exception) -> Response:
    """A bug: a 500 in OpenAI's shape (Starlette still logs the traceback and re-raises it to the server)."""
    return SafeJSONResponse(error_body(_internal_message(error), 500), status_code=500)


_HANDLERS: dict[Any, Callable[[Request, Any], Awaitable[Response]]] = {
    CtxIntegrationsError: _library_error, InvalidBody: _invalid_body, RequestValidationError: _invalid_request,
    StarletteHTTPException: _http_error, Exception: _internal_error,
}


# -- the app -------------------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await app.state.server.backend.close()


def create_app(engine: Any = None, store: Any = None, *, backend: Backend | None = None, retriever: Any = None,
               max_in_flight: int | None = None, model_name: str | Sequence[str] | None = None,
               limits: ServerLimits | None = None, api_key: str | Sequence[str] | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (or ``backend``), retrieving from ``store`` when given.

    ``store``: a :class:`~ctx_integrations.retrieval.DocumentStore` (a folder or a Chroma server URL);
    requests without inline documents get the ``top_k`` best of it, every score kept.
    ``max_in_flight``: requests admitted at once; beyond it the server answers 503 with Retry-After.
    ``model_name``: the name(s) the server answers to (``--served-model-name``; the first is reported,
    chat requests naming another model get 404 ``model_not_found``); default :func:`model_id` of the
    engine's model name. ``api_key``: one key or several; with any, every ``/v1`` route requires
    ``Authorization: Bearer KEY`` (:mod:`~ctx_integrations.serve.auth`).
    ``limits``: body size, read deadline and field sizes (:class:`~ctx_integrations.serve.limits.ServerLimits`;
    default ``ServerLimits()``). Run the app with :func:`ctx_integrations.serve.http_server.run` to have
    uvicorn close connections whose headers never finish within ``limits.read_timeout_s`` as well, and
    to print the access log. The engine is closed (``engine.close()``, when it has one) when the server
    shuts down, after uvicorn has drained the requests in flight.
    """
    if backend is None:
        if engine is None:
            raise InvalidOptionError("create_app needs an engine (or a backend)")
        backend = LocalBackend(engine)
    if limits is not None and not isinstance(limits, ServerLimits):
        raise InvalidOptionError(f"limits must be a ServerLimits, got {type(limits).__name__}")
    loaded = getattr(getattr(engine, "loaded", None), "name", None)
    names = served_model_names(model_name, model_id(loaded or "ctx-integrations"))
    root = loaded or names[0]
    keys = api_keys(api_key)
    app = FastAPI(title="ctx-integrations", version="0.1.0", lifespan=_lifespan,
                  default_response_class=SafeJSONResponse, exception_handlers=_HANDLERS)
    app.state.server = ServerState(backend, store, retriever, max_in_flight, names, root, limits or ServerLimits())
    app.include_router(router)
    # the last added runs first: the access log sees every request; the header size and then the key are checked
    # before the body is read
    app.add_middleware(BodyLimitMiddleware, limits=app.state.server.limits)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(HeaderLimitMiddleware, limits=app.state.server.limits)
    app.add_middleware(AccessLogMiddleware)
    app.openapi = _with_body_schemas(app)  # type: ignore[method-assign]
    return app
