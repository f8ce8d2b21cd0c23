"""The GPU placement rules of Ray Serve replicas (serve/gpu_placement.py), without Ray: pure functions."""

from __future__ import annotations

import math

import pytest

from ctx_integrations.errors import InvalidOptionError
from ctx_integrations.serve.gpu_placement import (
    DEFAULT_CPU_REPLICAS,
    check_gpus_per_replica,
    check_replica_device,
    default_gpus_per_replica,
    replica_count,
    replica_device,
    replicas_per_node,
)


@pytest.mark.parametrize("value", [0, 0.25, 0.5, 1, 2, 4])
def test_zero_a_fraction_of_one_gpu_or_whole_gpus_are_accepted(value):
    assert check_gpus_per_replica(value) == value


@pytest.mark.parametrize(("value", "says"), [(-1, ">= 0"), (-0.5, ">= 0"), (1.5, "whole number"), (2.25, "whole"),
                                             (math.nan, ">= 0"), (math.inf, ">= 0")])
def test_negative_non_finite_and_fractions_above_one_are_refused(value, says):
    """Bug caught: a value Ray refuses (or a negative reservation) reaching ``ray_actor_options``."""
    with pytest.raises(InvalidOptionError, match=says):
        check_gpus_per_replica(value)


@pytest.mark.parametrize(("device", "cuda", "expected"), [
    (None, True, 1), ("cuda", True, 1), ("cuda:0", True, 1), (None, False, 0), ("cuda", False, 0),
    ("cpu", True, 0), ("mps", True, 0)])
def test_the_default_is_one_gpu_when_the_driver_has_cuda_unless_the_device_is_another_kind(device, cuda, expected):
    """Bugs caught: replicas reserving no GPU on a CUDA machine (all on cuda:0, the issue), or reserving one for
    ``--device cpu``."""
    assert default_gpus_per_replica(device, cuda) == expected


@pytest.mark.parametrize(("device", "gpus", "assigned", "visible", "expected"), [
    # Ray set CUDA_VISIBLE_DEVICES to the replica's GPU: whatever its physical id, torch sees it as cuda:0
    (None, 1, ["3"], "3", "cuda:0"),
    ("cuda", 1, ["1"], "1", "cuda:0"),
    ("cuda:0", 1, ["1"], "1", "cuda:0"),
    ("cuda:1", 2, ["2", "3"], "2,3", "cuda:1"),
    (None, 0.5, ["0"], "0", "cuda:0"),  # two replicas sharing GPU 0
    # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the variable is the node's, or unset
    (None, 1, ["3"], "2,3", "cuda:1"),
    (None, 1, ["3"], None, "cuda:3"),
    # no GPU reserved: the device as given, else the CPU (not the unreserved cuda:0 the engine would default to)
    (None, 0, [], None, "cpu"),
    ("cpu", 0, [], "0,1", "cpu"),
    ("cuda:1", 0, [], None, "cuda:1"),
])
def test_a_replica_uses_the_gpu_ray_assigned_it(device, gpus, assigned, visible, expected):
    """Bugs caught: ``cuda:<physical id>`` inside a replica whose CUDA_VISIBLE_DEVICES hides the others (a CUDA
    error on every replica but GPU 0's), or every replica on cuda:0 when Ray did not set the variable."""
    assert replica_device(device, gpus, assigned, visible) == expected


@pytest.mark.parametrize(("device", "gpus", "says"), [
    ("cuda", 0, "reserves no GPU"),
    ("cpu", 1, "never use"),
    ("cuda:1", 1, "cuda:0..0"),
    ("cuda:2", 2, "cuda:0..1"),
    ("cuda:x", 1, "cuda or cuda:N"),
])
def test_contradictory_device_and_reservation_are_refused_on_the_driver(device, gpus, says):
    """Bugs caught: GPUs reserved for engines on the CPU, an index past what the replica sees (a CUDA error in
    every replica, after Ray placed them), plain ``cuda`` with nothing reserved (all replicas on one GPU)."""
    with pytest.raises(InvalidOptionError, match=says):
        check_replica_device(device, gpus)


def test_a_replica_refuses_an_assignment_it_cannot_see():
    """Bug caught: a replica silently taking cuda:0 when Ray's GPU id is not among the visible devices."""
    with pytest.raises(InvalidOptionError, match="CUDA_VISIBLE_DEVICES"):
        replica_device("cuda", 1, ["2"], "0,1")
    with pytest.raises(InvalidOptionError, match="assigned it"):
        replica_device("cuda", 1, [], "0")


@pytest.mark.parametrize(("node", "gpus", "expected"), [
    (1, 1, 1), (8, 1, 8), (1, 0.5, 2), (2, 0.5, 4), (1, 0.3, 3), (1, 0.1, 10), (4, 2, 2), (3, 2, 1), (1, 2, 0),
    (0, 1, 0)])
def test_replicas_per_node_packs_fractions_per_gpu_and_whole_gpus_per_node(node, gpus, expected):
    """Bugs caught: 1 // 0.1 = 9 (float rounding), or 3 replicas of 0.6 counted on 2 GPUs (they do not share)."""
    assert replicas_per_node(node, gpus) == expected


def test_the_replica_count_is_one_per_gpu_of_the_cluster_when_not_given():
    assert replica_count(None, 1, [2, 1]) == 3
    assert replica_count(None, 0.5, [1, 1]) == 4
    assert replica_count(None, 2, [2, 2, 1]) == 2  # a 2-GPU replica cannot span the 1-GPU node
    assert replica_count(None, 0, []) == DEFAULT_CPU_REPLICAS  # no GPU reserved: as before
    assert replica_count(3, 0, []) == 3
    assert replica_count(2, 1, [4]) == 2


@pytest.mark.parametrize(("replicas", "gpus", "nodes"), [(None, 1, []), (None, 1, [0, 0]), (3, 1, [2]),
                                                         (2, 2, [1, 1]), (3, 0.6, [2])])
def test_too_few_gpus_in_the_cluster_is_an_error_naming_them(replicas, gpus, nodes):
    """Bug caught: Serve waiting forever for replicas the cluster has no GPUs for (it never reports it)."""
    with pytest.raises(InvalidOptionError, match="do not fit this Ray cluster"):
        replica_count(replicas, gpus, nodes)


def test_a_replica_count_below_one_is_refused():
    with pytest.raises(InvalidOptionError, match="--replicas must be >= 1"):
        replica_count(0, 0, [])


@pytest.mark.parametrize(("device", "gpus", "expected"), [("cuda", 1, "cuda:0"), (None, 2, "cuda:0"),
                                                          ("cuda:1", 2, "cuda:1"), (None, 0, "cpu")])
def test_the_driver_accepts_what_a_replica_will_be_able_to_use(device, gpus, expected):
    """Bug caught: the driver's check refusing (or crashing on) a valid device, as if Ray had assigned nothing."""
    assert check_replica_device(device, gpus) == expected


def test_one_replica_is_one_replica():
    """Bugs caught: an explicit ``--replicas 1`` refused, or one GPU's cluster asked for two replicas."""
    assert replica_count(1, 0, []) == 1
    assert replica_count(1, 1, [1]) == 1
    assert replica_count(None, 1, [1]) == 1


@pytest.mark.parametrize(("call", "says"), [
    (lambda: check_gpus_per_replica(1.5), "use a fraction up to 1 to share one GPU, or 2, 3, ... GPUs"),
    (lambda: check_replica_device("cuda", 0), "pass --gpus-per-replica (1 per GPU), or cuda:N to pin every replica "
                                              "to GPU N yourself"),
    (lambda: check_replica_device("cpu", 1), "pass --gpus-per-replica 0 to run them there"),
    (lambda: replica_count(None, 1, []), "(GPUs per node: none; room for 0): add GPUs, lower --replicas or "
                                         "--gpus-per-replica, or pass --gpus-per-replica 0 for the CPU"),
    (lambda: replica_count(3, 1, [1, 1]), "(GPUs per node: [1, 1]; room for 2)"),
])
def test_each_refusal_says_what_to_do(call, says):
    """Bug caught: a refusal whose advice was lost or garbled (the message is the user's only guide)."""
    with pytest.raises(InvalidOptionError) as raised:
        call()
    assert says in str(raised.value)
