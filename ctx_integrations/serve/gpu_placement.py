"""Which GPUs a Ray Serve replica reserves, how many replicas a cluster holds, and which device a replica's engine uses.

Pure functions (no Ray, no torch): the CLI checks its flags with them before Ray starts, and a replica calls
:func:`replica_device` with what Ray gave it. Why a module of its own: the rule ties three sources together
(the command line, Ray's per-node GPU resources, the ``CUDA_VISIBLE_DEVICES`` Ray sets in each replica) and
is easier to get right, and to test, without a cluster.

Ray gives a replica that reserves ``num_gpus`` GPU ids of its node (``get_accelerator_ids()["GPU"]``) and sets
``CUDA_VISIBLE_DEVICES`` to them, so inside the replica ``cuda`` (= ``cuda:0``) is its own first GPU; with
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` Ray leaves the variable alone and the index is the assigned
id's place among the GPUs the process sees. A replica that reserves no GPU keeps the variable it inherits
(Ray 2.60), so without a device it would take ``cuda:0`` unreserved: it runs on the CPU unless told otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ctx_integrations.errors import InvalidOptionError

DEFAULT_CPU_REPLICAS = 2  # replicas when none reserves a GPU and --replicas is not given (as before GPUs)
_SLACK = 1e-9  # 1 / 0.1 is 10.000000000000002, and 0.3 * 10 replicas must fit 3 GPUs


def check_gpus_per_replica(value: float) -> float:
    """``value`` if Ray can reserve it for one replica: 0 (CPU), a fraction of one GPU, or a whole number of GPUs.

    Ray refuses fractions above 1 (a replica cannot hold 1.5 GPUs); it is refused here, before Ray starts."""
    if not math.isfinite(value) or value < 0:
        raise InvalidOptionError(f"--gpus-per-replica must be >= 0 (0: replicas on the CPU), got {value}")
    if value > 1 and value != int(value):
        raise InvalidOptionError(f"--gpus-per-replica above 1 must be a whole number of GPUs, got {value}: "
                                 "use a fraction up to 1 to share one GPU, or 2, 3, ... GPUs")
    return float(value)


def _cuda_index(device: str | None) -> tuple[bool, int | None]:
    """(whether ``device`` is CUDA, its index or None): ``"cuda"`` -> (True, None), ``"cuda:1"`` -> (True, 1)."""
    if device is None:
        return False, None
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return False, None
    if index and not index.isdigit():
        raise InvalidOptionError(f"--device {device!r}: a CUDA device is cuda or cuda:N")
    return True, int(index) if index else None


def default_gpus_per_replica(device: str | None, cuda_available: bool) -> float:
    """1 when the driver has CUDA and ``--device`` does not name another kind of device, else 0."""
    if device is not None and not _cuda_index(device)[0]:
        return 0.0
    return 1.0 if cuda_available else 0.0


def replica_device(device: str | None, gpus_per_replica: float, assigned: Sequence[str] = (),
                   visible: str | None = None) -> str:
    """The torch device of a replica's engine, from ``--device``, its reservation and what Ray assigned it.

    ``assigned``: the GPU ids Ray gave the replica; ``visible``: its ``CUDA_VISIBLE_DEVICES`` (None: unset).
    No GPU reserved: ``device`` as given, else ``"cpu"``; plain ``cuda`` is refused there (every replica would
    take the same unreserved GPU). GPUs reserved: ``cuda:K`` (default 0) is the replica's K-th assigned GPU,
    as torch numbers it among the visible ones; another kind of device is refused (it would hold GPUs it
    never uses).
    """
    is_cuda, index = _cuda_index(device)
    if gpus_per_replica == 0:
        if is_cuda and index is None:
            raise InvalidOptionError("--device cuda with --gpus-per-replica 0: Ray reserves no GPU, so every replica "
                                     "would load its model on the same one; pass --gpus-per-replica (1 per GPU), "
                                     "or cuda:N to pin every replica to GPU N yourself")
        return device or "cpu"
    if device is not None and not is_cuda:
        raise InvalidOptionError(f"--device {device} with --gpus-per-replica {gpus_per_replica:g}: the replicas "
                                 "would reserve GPUs they never use; pass --gpus-per-replica 0 to run them there")
    owned = max(1, math.ceil(gpus_per_replica))
    index = index or 0
    if index >= owned:
        raise InvalidOptionError(f"--device {device} with --gpus-per-replica {gpus_per_replica:g}: each replica sees "
                                 f"only the {owned} GPU(s) Ray gives it, as cuda:0..{owned - 1}; pass --device cuda")
    if len(assigned) <= index:
        raise InvalidOptionError(f"this replica reserved {gpus_per_replica:g} GPU(s) but Ray assigned it "
                                 f"{list(assigned)}: is the cluster's GPU resource a real one on this node?")
    if not visible:  # Ray left CUDA_VISIBLE_DEVICES unset: torch numbers the node's GPUs by their ids
        return f"cuda:{int(assigned[index])}"
    seen = [part.strip() for part in visible.split(",")]
    if assigned[index] not in seen:
        raise InvalidOptionError(f"Ray assigned GPU {assigned[index]} to this replica but CUDA_VISIBLE_DEVICES is "
                                 f"{visible!r}: unset it where `ray start` runs, or list that GPU")
    return f"cuda:{seen.index(assigned[index])}"


def check_replica_device(device: str | None, gpus_per_replica: float) -> str:
    """:func:`replica_device` on the driver, before Ray starts: as for a replica Ray gave its first GPU(s)."""
    return replica_device(device, gpus_per_replica, [str(i) for i in range(math.ceil(gpus_per_replica))])


def replicas_per_node(node_gpus: float, gpus_per_replica: float) -> int:
    """How many replicas of ``gpus_per_replica`` fit one node with ``node_gpus`` GPUs (a fraction shares one GPU;
    a whole number must fit one node, as Ray places a replica on one node)."""
    if gpus_per_replica <= 1:
        return math.floor(node_gpus + _SLACK) * math.floor(1 / gpus_per_replica + _SLACK)
    return math.floor(node_gpus / gpus_per_replica + _SLACK)


def replica_count(replicas: int | None, gpus_per_replica: float, node_gpus: Sequence[float]) -> int:
    """``replicas`` if given (and it fits the cluster), else one per ``gpus_per_replica`` GPUs of the cluster.

    ``node_gpus``: the GPUs of each node of the cluster. Replicas that do not fit are refused here: Ray Serve
    would otherwise wait forever for the resources of the ones it cannot place.
    """
    if replicas is not None and replicas < 1:
        raise InvalidOptionError(f"--replicas must be >= 1, got {replicas}")
    if gpus_per_replica == 0:
        return replicas if replicas is not None else DEFAULT_CPU_REPLICAS
    fits = sum(replicas_per_node(gpus, gpus_per_replica) for gpus in node_gpus)
    wanted = replicas if replicas is not None else max(fits, 1)
    if wanted > fits:
        raise InvalidOptionError(f"{wanted} replica(s) of {gpus_per_replica:g} GPU(s) do not fit this Ray cluster "
                                 f"(GPUs per node: {list(node_gpus) or 'none'}; room for {fits}): add GPUs, "
                                 "lower --replicas or --gpus-per-replica, or pass --gpus-per-replica 0 for the CPU")
    return wanted
