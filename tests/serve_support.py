"""Real server processes for the serving tests: a tiny random-weight engine behind uvicorn on 127.0.0.1.

``python -c "from tests.serve_support import main; main()" PORT [--store DIR] [--max-in-flight N] [limits] [api]``
(the limits are ``ctx-experts serve``'s flags, e.g. ``--max-body-bytes``, ``--read-timeout``; api its
``--api-key``, ``--served-model-name``, ``--no-access-log``)
runs the app from :func:`ctx_integrations.serve.app.create_app` on the same tiny model the tests
build in-process (same seed, same weights), so an HTTP answer can be compared token for token with
``engine.generate``. :func:`start_server` launches it and waits for ``/healthz``; the process is
killed after ``deadline_s`` at the latest, so a hung test never leaves a server behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TINY_POSITIONS = 8192


class CannedBackend:
    """A serve backend (``ctx_integrations.serve.backend.Backend``) that answers every job at once with
    :meth:`canned` and streams :attr:`pieces` before it: what the HTTP-layer tests put behind ``create_app`` when
    the answer's content, not the model, is under test. ``jobs`` keeps every answer and stream job it got."""

    pieces: tuple[str, ...] = ("an ", "answer")

    def __init__(self) -> None:
        self.jobs: list[dict] = []

    def canned(self) -> dict:
        return {"text": "an answer", "mode": "pced", "token_ids": [1, 2], "trace": [], "finish_reason": "stop",
                "timings": {"prompt_tokens": 3.0}, "cache": {}, "documents": []}

    async def answer(self, job: dict) -> dict:
        self.jobs.append(job)
        return self.canned()

    async def stream(self, job: dict):
        self.jobs.append(job)
        for piece in self.pieces:
            yield {"token": piece}
        yield {"answer": self.canned()}

    async def batch(self, job: dict) -> list[dict]:
        return [self.canned() for _ in job["queries"]]

    def stats(self) -> dict:
        return {}

    async def close(self) -> None:
        return None


def tiny_engine(cache_dir=None):
    from ctx_integrations import Engine
    from tests.helpers import tiny_loaded

    return Engine(tiny_loaded("llama", max_position_embeddings=TINY_POSITIONS), cache_dir=cache_dir)


def replica_stats(count: int, app_name: str = "ctx") -> dict[str, dict]:
    """Every ``EngineReplica``'s ``stats()`` (its device and placement) by replica name, asked through the
    deployment's handle until ``count`` replicas answered (the router spreads calls without documents)."""
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", app_name=app_name)
    seen: dict[str, dict] = {}
    for _ in range(20 * count):
        stats = handle.stats.remote().result(timeout_s=60)
        seen[stats["replica"]] = stats
        if len(seen) == count:
            break
    return seen


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    import torch

    from ctx_integrations.serve.app import create_app
    from ctx_integrations.serve.cli import add_api_arguments, add_limit_arguments, api_keys_from, limits_from
    from ctx_integrations.serve.http_server import run

    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--store", default=None)
    parser.add_argument("--max-in-flight", type=int, default=None)
    parser.add_argument("--lifetime", type=float, default=600.0)
    add_limit_arguments(parser)
    add_api_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = None
    engine = tiny_engine()
    if args.store:
        from ctx_integrations.cli import load_demo_corpus
        from ctx_integrations.retrieval.store import DocumentStore

        store = DocumentStore(args.store)
        if store.count() == 0:
            store.add(load_demo_corpus()[0], warm=False)
    signal.alarm(int(args.lifetime))  # never outlive the test session
    app = create_app(engine, store, max_in_flight=args.max_in_flight, limits=limits_from(args),
                     model_name=args.served_model_name, api_key=api_keys_from(args) or None)
    run(app, host="127.0.0.1", port=args.port, drain_timeout=30, access_log=args.access_log)


@contextmanager
def start_server(*extra: str, log: Path, deadline_s: float = 600.0, env: dict[str, str] | None = None):
    """Start a server process; yield ``(base_url, process)``; stop it (SIGTERM, then SIGKILL) afterwards.

    ``env``: variables for the server beyond this process's (whose ``$CTX_API_KEY`` is not passed on).
    """
    port = free_port()
    inherited = {name: value for name, value in os.environ.items() if name != "CTX_API_KEY"}
    env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-c", "from tests.serve_support import main; main()", str(port),
                                    "--lifetime", str(deadline_s), *extra], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log)
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")
        time.sleep(0.3)


def sse_events(lines) -> list[tuple[str | None, str]]:
    """Parse server-sent events from an iterator of lines into ``(event, data)`` pairs."""
    events, event, data = [], None, []
    for line in lines:
        if line == "":
            if data:
                events.append((event, "\n".join(data)))
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        events.append((event, "\n".join(data)))
    return events


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample in ``/metrics`` text (0.0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{wanted}}}" if labels else name) or (
                labels and key.startswith(name + "{") and set(key[len(name) + 1:-1].split(",")) == set(
                    wanted.split(","))):
            return float(value)
    return 0.0


_RUN_CHROMA = ("import sys; from chromadb.cli.cli import app; "
               "sys.argv = ['chroma', 'run', '--host', '127.0.0.1', '--path', sys.argv[1], '--port', sys.argv[2]]; "
               "app()")


@contextmanager
def chroma_server(data: Path, timeout_s: float = 90.0):
    """A real ``chroma run`` server on a free 127.0.0.1 port; yields its URL; stopped afterwards."""
    import chromadb

    port = free_port()
    with (data / "chroma.log").open("w") as log:
        server = subprocess.Popen([sys.executable, "-c", _RUN_CHROMA, str(data / "db"), str(port)], stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                chromadb.HttpClient(host="127.0.0.1", port=port).heartbeat()
                break
            except Exception:
                if server.poll() is not None or time.monotonic() > deadline:
                    log = (data / "chroma.log").read_text()[-2000:]
                    raise RuntimeError(f"chroma run did not start: {log}") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Read until the server closes the connection; (closed in time, what it sent)."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
        return True, received
    except TimeoutError:
        return False, received
    except ConnectionResetError:
        return True, received
