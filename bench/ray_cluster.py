"""The local multi-node Ray cluster the Ray benchmarks run on, or a running one (``--address``).

Their layout: a head node with the custom resource ``head_node`` and one CPU (the driver, and
the one actor the bench keeps off the worker nodes), and worker nodes with the bench's own
resource (``engine_node``, ``trainer_node``) and one CPU each. The tests' cluster has that
shape (a head with ``head_node``, two workers with ``engine_node`` and ``trainer_node``), so
the tests pass its address instead of starting a cluster per benchmark, as ``bench.chaos``
does.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray.cluster_utils import Cluster

from bench.cli import refuse

HEAD = "head_node"


def add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="a running Ray cluster to use instead of starting one: a head with "
                             f"the {HEAD} resource and the worker nodes the bench needs, free")


@contextmanager
def connected(bench: str, address: str | None, workers: int, resource: str,
              store_bytes: int) -> Iterator[None]:
    """The driver connected to a cluster of a ``head_node`` head and ``workers`` worker nodes
    with ``resource`` (one CPU each): one started here and shut down on leaving, or the one at
    ``address``, checked to have them (a refusal in one line otherwise)."""
    started = time.perf_counter()
    cluster = None
    if address is None:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {HEAD: 1}, "object_store_memory": store_bytes,
            "include_dashboard": False})
        for _ in range(workers):
            cluster.add_node(num_cpus=1, resources={resource: 1}, object_store_memory=store_bytes)
        cluster.wait_for_nodes()
    try:
        ray.init(address=address or cluster.address, namespace="bench",  # type: ignore[union-attr]
                 logging_level="warning", log_to_driver=False)
        if cluster is None:
            nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
            heads = sum(1 for n in nodes if n.get(HEAD, 0) >= 1 and n.get("CPU", 0) >= 1)
            found = sum(1 for n in nodes if n.get(resource, 0) >= 1 and n.get("CPU", 0) >= 1)
            if not heads or found < workers:
                refuse(bench, f"the cluster at {address} has {heads} node(s) with {HEAD} and "
                              f"{found} with {resource} (one CPU each); it needs 1 and {workers}")
            print(f"cluster: the one at {address} ({found} {resource} nodes)", flush=True)
        else:
            print(f"cluster: head + {workers} {resource.split('_')[0]} nodes up in "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
        yield
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
