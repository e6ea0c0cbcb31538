"""The peers of a weight-update group: the rolloutds watching the job's versions when rank 0 announces.

rank 0 waits for exactly these (flexmarl.weight_group); a watcher without a worker id (the SDK,
a dashboard) is no peer, a rolloutd watching every job is a peer of each, and one whose stream
ended is not counted any more.
"""

from __future__ import annotations

import json
import types
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flexmarl.errors import InvalidArgument
from flexmarl.v1 import orchestrator_pb2
from flexmarl.weight_group import WeightGroupRecord, WeightTensor, from_message, to_message
from orchestratord.coordinator import JobCoordinator
from orchestratord.metrics import OrchestratorMetrics
from orchestratord.servicer import OrchestratorServicer
from orchestratord.state import InMemoryStateStore

from .helpers import spec_dict

RECORD = WeightGroupRecord("127.0.0.1", 41000, "flexmarl-weights-job-a-sender", 0, "gloo", 30.0,
                           ((WeightTensor("w", "float32", (2,)),),))


def _watch(servicer: OrchestratorServicer, job_id: str, worker_id: str) -> Any:
    request = orchestrator_pb2.WatchAgentVersionsRequest(job_id=job_id, worker_id=worker_id)
    return servicer.WatchAgentVersions(request, None)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
async def test_announced_groups_name_the_rolloutds_watching_the_job() -> None:
    registry: Any = types.SimpleNamespace(prefix="/test")  # never called: nothing here reaches etcd or stored
    coordinator = JobCoordinator(registry, OrchestratorMetrics(CollectorRegistry()))
    coordinator.state = InMemoryStateStore()
    await coordinator.submit_job(json.dumps(spec_dict()), "job-a")
    await coordinator.submit_job(json.dumps(spec_dict(name="other")), "job-b")
    servicer = OrchestratorServicer(coordinator)
    streams = {"one": _watch(servicer, "job-a", "rolloutd-1"), "every": _watch(servicer, "", "rolloutd-0"),
               "other": _watch(servicer, "job-b", "rolloutd-2"), "sdk": _watch(servicer, "job-a", "")}
    try:
        for stream in streams.values():
            first = await anext(stream)  # the stream is open (the current versions come first)
            assert first.version == 0
        peers = await coordinator.announce_weights("job-a", "sender", 1, RECORD)
        assert peers == ("rolloutd-0", "rolloutd-1")
        while not (message := await anext(streams["one"])).HasField("weight_group"):
            pass
        assert from_message(message.weight_group).peers == peers and message.version == 1
        response = await servicer.AnnounceWeights(orchestrator_pb2.AnnounceWeightsRequest(
            worker_id="traind-0", slot_id="traind-0/slot0", job_id="job-a", agent="receiver", version=1,
            weight_group=to_message(RECORD)), None)  # type: ignore[arg-type]
        assert list(response.peers) == ["rolloutd-0", "rolloutd-1"]
        await streams.pop("one").aclose()  # rolloutd-1 stops watching: no longer a peer
        assert await coordinator.announce_weights("job-a", "sender", 2, RECORD) == ("rolloutd-0",)
    finally:
        for stream in streams.values():
            await stream.aclose()
    assert coordinator.version_peers("job-a") == ()
    with pytest.raises(InvalidArgument, match="worker_id"):
        await anext(_watch(servicer, "job-a", "bad id\n"))

