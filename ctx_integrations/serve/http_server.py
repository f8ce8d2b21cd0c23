"""Run an app from :func:`~ctx_integrations.serve.app.create_app` on uvicorn with its read limits applied.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and bounds the header size
(``h11_max_incomplete_event_size``, refused with a plain-text 400), but it has no deadline for a request
that is being sent: a client that sends half its headers, or half its body, and then waits holds the
connection forever.
:class:`ReadDeadlineProtocol` is uvicorn's h11 protocol with that deadline: a connection whose
request has not fully arrived ``read_timeout_s`` after the connection opened (or after the previous
response) is closed. The app's own 408 (:class:`~ctx_integrations.serve.limits.BodyLimitMiddleware`)
answers a slow body politely; this closes what the app never sees (unfinished headers, the rest of
a refused body). A body still arriving when the deadline passes gets one more period, so that the
app's 408 is sent before the connection is closed. Headers that pass ``max_header_bytes`` while they
arrive (h11 refuses them, suggesting 431) are answered 431 with an OpenAI-shaped body, as the app's own
:class:`~ctx_integrations.serve.limits.HeaderLimitMiddleware` answers headers that arrived whole.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ctx_integrations.serve.access_log import ACCESS_LOGGER
from ctx_integrations.serve.errors import error_bytes
from ctx_integrations.serve.limits import ServerLimits, headers_too_large

_TOO_LARGE = 431


class _Connection(h11.Connection):
    """h11's connection, remembering the status h11 suggests for the request it refused (431: headers too large)."""

    refused_status = 400

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as error:
            self.refused_status = error.error_status_hint
            raise


class ReadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request is not received within ``read_timeout_s``, and
    answering headers over ``max_header_bytes`` with 431 in OpenAI's error shape (uvicorn's is a plain-text 400)."""

    read_timeout_s = ServerLimits.read_timeout_s
    max_header_bytes = ServerLimits.max_header_bytes

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, max_incomplete_event_size=self.max_header_bytes)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused: kept for malformed requests, 431 for oversized headers."""
        if self.conn.refused_status != _TOO_LARGE:
            super().send_400_response(msg)
            return
        body = error_bytes(headers_too_large(self.max_header_bytes), _TOO_LARGE, "headers")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=_TOO_LARGE, headers=headers, reason=b"Request Header Fields Too Large"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._grace_given = False
        self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        deadline = getattr(self, "_read_deadline", None)
        if deadline is not None:
            deadline.cancel()
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        previous = getattr(self, "_read_deadline", None)
        if previous is not None:
            previous.cancel()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_deadline_passed)

    def _read_deadline_passed(self) -> None:
        # IDLE: headers not (all) received yet; SEND_BODY: body not all received. DONE: the request is in
        # the app (its own timeout applies); the next deadline starts with the response.
        state = self.conn.their_state
        if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
            return
        if state is h11.SEND_BODY and self.cycle is not None and not self.cycle.response_complete:
            # the app's body deadline started after the headers, so it has not answered 408 yet: give it one more
            # period (then this closes the connection whatever the app does)
            if not getattr(self, "_grace_given", False):
                self._grace_given = True
                self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_deadline_passed)
                return
        self.transport.close()


def protocol_for(limits: ServerLimits) -> type[H11Protocol]:
    """A :class:`ReadDeadlineProtocol` subclass with ``limits.read_timeout_s`` and ``limits.max_header_bytes``
    (uvicorn builds one per connection)."""
    return type("ReadDeadlineProtocol", (ReadDeadlineProtocol,),
                {"read_timeout_s": limits.read_timeout_s, "max_header_bytes": limits.max_header_bytes})


def log_config(access_log: bool = True) -> dict[str, Any]:
    """uvicorn's logging configuration plus the access logger (:mod:`~ctx_integrations.serve.access_log`).

    Its lines go to stdout in uvicorn's default format (``INFO:     127.0.0.1:50212 - "POST /v1/answer
    HTTP/1.1" 200 84.3ms``); ``access_log=False`` keeps only its warnings.
    """
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["ctx_access"] = {"formatter": "default", "class": "logging.StreamHandler",
                                        "stream": "ext://sys.stdout"}
    config["loggers"][ACCESS_LOGGER] = {"handlers": ["ctx_access"], "level": "INFO" if access_log else "WARNING",
                                        "propagate": False}
    return config


def run(app: Any, *, host: str, port: int, drain_timeout: float | None = 30.0, log_level: str = "warning",
        access_log: bool = True) -> None:
    """``uvicorn.run`` with the app's read deadline for headers and bodies, a bounded header size, and the app's
    access log (one line per request with its duration) instead of uvicorn's (``access_log=False``: none).

    The GIL switch interval drops from 5 ms to 1 ms: the engine's scheduler thread runs Python between
    its forward passes, and the event loop waits up to one interval for the GIL at every await, so
    ``/healthz`` and token delivery stay in the low milliseconds while 8 requests decode.
    """
    import sys

    import uvicorn

    sys.setswitchinterval(0.001)
    limits: ServerLimits = getattr(getattr(app.state, "server", None), "limits", None) or ServerLimits()
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                http=protocol_for(limits), h11_max_incomplete_event_size=limits.max_header_bytes,
                log_config=log_config(access_log), access_log=False)
