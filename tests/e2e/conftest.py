"""End-to-end fixtures: whole local clusters (etcd + the four daemons) shared by several tests.

Starting a cluster and its first engine costs ~40 s on a 2-core machine, so tests share:
one session cluster (1 traind slot, 1 engine replica) for the pipeline and equivalence
tests, and one cluster per fault module. Each test submits its own job; a fault test's
victims are restarted before the next test (``heal``). Helpers and checks: e2e_support.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import E2ECluster, heal, running_cluster


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory of materialised tiny checkpoints for the whole session."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def _session_cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[E2ECluster]:
    with running_cluster(tmp_path_factory.mktemp("shared"), models_dir, trainer_workers=1, trainer_slots=1,
                         engine_replicas=1) as e2e:
        yield e2e


@pytest.fixture
def shared_cluster(_session_cluster: E2ECluster) -> E2ECluster:
    """The session's cluster: one traind with one slot, one rolloutd with one engine replica."""
    heal(_session_cluster)
    return _session_cluster
