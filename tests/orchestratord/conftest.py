"""Fixtures of the StateStore contract tests (test_state.py, test_history_archive.py)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator

import pytest

from flexmarl.cluster import EtcdServer
from flexmarl.registry import Registry
from orchestratord.etcd_state import EtcdStateStore
from orchestratord.state import InMemoryStateStore, StateStore

_PREFIXES = itertools.count()


@pytest.fixture(scope="module")
def module_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the module (each test gets its own key prefix)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["memory", "etcd"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    """Every StateStore implementation: the in-memory reference and etcd on a real server."""
    if request.param == "memory":
        yield InMemoryStateStore()
        return
    etcd: EtcdServer = request.getfixturevalue("module_etcd")
    registry = Registry(etcd.endpoint, f"/state-contract-{next(_PREFIXES)}")
    await registry.connect()
    try:
        yield EtcdStateStore(registry)
    finally:
        await registry.close()
