"""``ctx-experts serve --ray``'s GPU and cluster flags: refused before Ray starts, else handed to the app and Ray.

Ray is never started here: ``connect`` / ``start`` / ``stop`` are stubbed (the cluster tests are
tests/test_serve_ray.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ctx_integrations.serve.cli import RAY_FLAGS
from tests.helpers import run_cli

ray_app = pytest.importorskip("ctx_integrations.serve.ray_app")


class Stopped(Exception):
    """Raised by the stubbed ``start``: the command got as far as running the app."""


@pytest.fixture
def ray_calls(monkeypatch):
    """What the command asked of Ray and of ``build_app``; Ray itself refuses to start."""
    calls: dict = {"build_app": [], "connect": [], "start": [], "stop": []}
    build_app = ray_app.build_app

    def record(name, result=None, error=None):
        def call(*args, **kwargs):
            calls[name].append(kwargs)
            if error is not None:
                raise error
            return result(*args, **kwargs) if result else None
        return call

    import ray

    monkeypatch.setattr(ray, "init", record("ray.init", error=AssertionError("Ray started")))
    monkeypatch.setattr(ray_app, "build_app", record("build_app", build_app))
    monkeypatch.setattr(ray_app, "connect", record("connect"))
    monkeypatch.setattr(ray_app, "start", record("start", error=Stopped()))
    monkeypatch.setattr(ray_app, "stop", record("stop", lambda **_: {"total": 0.0}))
    monkeypatch.setattr(ray_app, "cluster_node_gpus", lambda: [1.0, 2.0])
    monkeypatch.setattr(ray_app, "local_gpus", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CTX_API_KEY", raising=False)
    return calls


@pytest.mark.parametrize(("argv", "says"), [
    (["--gpus-per-replica", "-1"], "--gpus-per-replica must be >= 0"),
    (["--gpus-per-replica", "1.5"], "whole number"),
    (["--gpus-per-replica", "nan"], "must be >= 0"),
    (["--gpus-per-replica", "1", "--device", "cpu"], "never use"),
    (["--gpus-per-replica", "0", "--device", "cuda"], "reserves no GPU"),
    (["--gpus-per-replica", "1", "--device", "cuda:1"], "pass --device cuda"),
    (["--gpus-per-replica", "1", "--replicas", "3"], "do not fit"),  # the local machine's 2 GPUs
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--ray-address", "auto", "--ray-cpus", "2"], "drop --ray-cpus"),
    (["--ray-address", "auto", "--gpus-per-replica", "-1"], ">= 0"),
    (["--ray-address", "auto", "--drain-timeout", "-1"], "drain_timeout_s"),
    (["--ray-address", "auto", "--replicas", "0"], "replicas must be >= 1"),
    (["--ray-address", "auto", "--device", "cpu", "--gpus-per-replica", "1"], "never use"),
])
def test_bad_flags_are_typed_errors_before_ray_starts(ray_calls, capsys, argv, says):
    """Bugs caught: a bad reservation reaching Ray (refused after it started, or never placed: Serve waits
    forever), or a local cluster started / a remote one joined before the flags were checked."""
    assert run_cli("serve", "--ray", *argv) == 2
    assert says in capsys.readouterr().err
    assert ray_calls["connect"] == ray_calls["start"] == []


@pytest.mark.parametrize("flag", [["--gpus-per-replica", "1"], ["--ray-address", "auto"], ["--replicas", "2"],
                                  ["--ray-cpus", "2"]])
def test_ray_flags_without_ray_are_refused(ray_calls, capsys, flag):
    """Bug caught: ``serve --gpus-per-replica 1`` silently serving one process that reserves nothing."""
    assert run_cli("serve", *flag) == 2
    assert "add --ray" in capsys.readouterr().err


def test_every_replica_gets_the_remote_cache_url(ray_calls):
    """Bug caught: ``--remote-cache-url`` kept by the gateway, so each replica kept private tiers only."""
    with pytest.raises(Stopped):
        run_cli("serve", "--ray", "--replicas", "2", "--remote-cache-url", "redis://10.0.0.7:6380/0")
    (built,) = ray_calls["build_app"]
    assert built["replicas"] == 2 and built["engine_options"]["remote_cache_url"] == "redis://10.0.0.7:6380/0"


def test_a_local_cluster_gets_one_replica_per_gpu_and_the_device(ray_calls):
    """Bugs caught: replicas not reserving their GPU (``ray_actor_options`` without ``num_gpus``), a local cluster
    started without the GPUs it counted, or --device not reaching the replicas."""
    with pytest.raises(Stopped):
        run_cli("serve", "--ray", "--gpus-per-replica", "1", "--device", "cuda", "--dtype", "float32")
    (built,) = ray_calls["build_app"]
    assert built["replicas"] == 2 and built["gpus_per_replica"] == 1
    assert built["engine_options"] == {"device": "cuda", "dtype": torch.float32}
    (started,) = ray_calls["start"]
    assert started["num_gpus"] == 2 and started["num_cpus"] == 2 and started.get("address") is None
    assert ray_calls["connect"] == []


def test_the_default_reserves_one_gpu_per_replica_when_the_driver_has_cuda(ray_calls, monkeypatch):
    """Bug caught: the issue's replicas with no GPU (every engine on cuda:0) when no flag is given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(Stopped):
        run_cli("serve", "--ray")
    (built,) = ray_calls["build_app"]
    assert built["gpus_per_replica"] == 1 and built["replicas"] == 2


def test_a_joined_cluster_is_counted_once_joined_and_left_alone_on_error(ray_calls):
    """Bugs caught: the count taken from this machine instead of the cluster's nodes, Ray's ``num_cpus`` passed
    when joining (Ray refuses it), or ``serve.shutdown()`` on a cluster shared with other Serve apps."""
    with pytest.raises(Stopped):
        run_cli("serve", "--ray", "--ray-address", "10.0.0.1:6379", "--gpus-per-replica", "0.5")
    assert ray_calls["connect"] == [{"address": "10.0.0.1:6379"}]
    replicas = [call["replicas"] for call in ray_calls["build_app"]]
    assert replicas[-1] == 6  # 2 per GPU on nodes of 1 and 2 GPUs
    (started,) = ray_calls["start"]
    assert started["address"] == "10.0.0.1:6379" and "num_cpus" not in started
    assert ray_calls["stop"] == [{"joined": True}]


def test_a_joined_cluster_with_too_few_gpus_is_left_with_an_error(ray_calls, capsys):
    """Bug caught: replicas deployed on a cluster that cannot place them (Serve waits forever, no error)."""
    assert run_cli("serve", "--ray", "--ray-address", "auto", "--gpus-per-replica", "1", "--replicas", "4") == 2
    assert "room for 3" in capsys.readouterr().err
    assert ray_calls["connect"] == [{"address": "auto"}] and ray_calls["start"] == []
    assert ray_calls["stop"] == [{"joined": True}]


def test_docs_serving_tables_the_ray_flags_and_cli_names_them():
    """Bug caught: a Ray flag added (to RAY_FLAGS, refused without --ray) but not documented, or one documented
    that is gone."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    section = (docs / "serving.md").read_text(encoding="utf-8").split("### GPUs and several machines")[1]
    table = next(block for block in section.split("\n\n") if block.startswith("| flag"))
    assert tuple(re.findall(r"^\| `(--[a-z-]+)", table, re.M)) == RAY_FLAGS
    cli = (docs / "cli.md").read_text(encoding="utf-8").replace("\n", " ")
    assert all(f"`{flag}`" in cli for flag in RAY_FLAGS)
