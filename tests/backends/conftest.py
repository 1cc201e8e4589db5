"""The Ray cluster of the test session: two simulated nodes on this machine, started once.

Token authentication off (otherwise Ray writes a token file in the home directory); workers at
the test's own priority. Each node
declares a custom resource named after it (`node_a`, `node_b`), so a recipe can pin actors to
one (`placement.engine_resources: {node_a: 1}`).
"""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_worker_niceness", "0")  # as backends/ray/place.py does for its own runtime


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 8}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, resources={"node_b": 8})
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def placements(ray_cluster, monkeypatch):
    """Every backend the program places in this test (a run through `pipeline.shell.run`), with
    the group ids each step trained."""
    from backends.place import place
    from pipeline.shell import run as shell_run

    found: list = []

    def capture(*args, **kwargs):
        placed = place(*args, **kwargs)
        found.append(placed)
        placed.trained = trained = []  # type: ignore[attr-defined]
        # Whether the engine served the trainer's weights as each step began.
        placed.agreed = agreed = []  # type: ignore[attr-defined]
        step = placed.trainer.train_step

        async def recording(items, *rest):
            trained.append({item.group_id for item in items})
            agreed.append(placed.engine.fingerprint() == placed.trainer.fingerprint())
            return await step(items, *rest)

        placed.trainer.train_step = recording
        return placed

    monkeypatch.setattr(shell_run, "place", capture)
    return found
