"""A real two-node Ray cluster on this machine for the Ray tests, with this test process connected as a driver."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def two_node_cluster() -> Iterator[object]:
    """A head and a second raylet, one logical CPU each (so two one-CPU bundles must land on different nodes)."""
    import ray
    from ray.cluster_utils import Cluster

    from pagedserve.common.ray_utils import RAY_NAMESPACE
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=RAY_NAMESPACE)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
