"""A throwaway ``redis-server`` on 127.0.0.1 for the remote KV tier's tests and benchmark: no persistence, idle
clients dropped, killed by its owner. Here so the tests and ``benchmarks/serving.py --remote-cache auto`` start
the same server the same way."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

INSTALL_HINT = "apt-get install redis-server (or valkey-server)"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(folder: str | Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """Start ``redis-server`` (``extra``: more of its flags) with its files in ``folder``; its process and URL once
    it answers ``PING``. Raises ``RuntimeError`` when it is not on PATH or does not start within 10 s."""
    import redis

    if shutil.which("redis-server") is None:
        raise RuntimeError(f"redis-server is not on PATH: {INSTALL_HINT}")
    port = free_port()
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(folder), "--timeout", "60", *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return process, url
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"redis-server on port {port} did not start") from None
            time.sleep(0.02)


def stop_server(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=10)
