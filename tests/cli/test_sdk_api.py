"""The SDK covers the public job API of the Orchestrator service, read from its descriptor.

Each public RPC maps to a Client and an AsyncClient method; calling that method against a
real gRPC server (a recording servicer on a loopback port) issues exactly that RPC.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from concurrent import futures
from typing import Any, cast

import grpc
import pytest
from cli_support import small_job

from flexmarl.client import AsyncClient, Client, JobInfo
from flexmarl.jobspec import parse_job_spec
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

SERVICE = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"]

#: RPC of the public job API -> SDK method (same name on Client and AsyncClient).
PUBLIC_RPCS = {
    "SubmitJob": "submit",
    "GetJob": "status",
    "ListJobs": "list_jobs",
    "CancelJob": "cancel",
    "WatchJob": "watch",
    "GetJobHistory": "history",
    "EvaluateJob": "evaluate",
}
#: RPCs that only rolloutd and traind call; deliberately not part of the SDK.
WORKER_RPCS = {
    "WatchAgentVersions", "LeaseRolloutTasks", "RenewLeases", "ReportRolloutTask",
    "PollTrainerWork", "AckMicroBatch", "CommitStep", "ReportSlotEvent", "AnnounceWeights",
}


def _status(job_id: str = "job-1", state: orchestrator_pb2.JobState.ValueType = orchestrator_pb2.JOB_STATE_SUCCEEDED,
            ) -> orchestrator_pb2.JobStatus:
    return orchestrator_pb2.JobStatus(job_id=job_id, name="signaling", state=state)


class RecordingOrchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    """Answers the public RPCs with fixed replies and records which RPC each call reached."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def SubmitJob(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("SubmitJob")
        return orchestrator_pb2.SubmitJobResponse(job_id=request.job_id or "job-1")

    def GetJob(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("GetJob")
        return _status(request.job_id)

    def ListJobs(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("ListJobs")
        return orchestrator_pb2.ListJobsResponse(jobs=[_status()])

    def CancelJob(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("CancelJob")
        return _status(request.job_id, orchestrator_pb2.JOB_STATE_CANCELLED)

    def WatchJob(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        self.calls.append("WatchJob")
        yield _status(request.job_id, orchestrator_pb2.JOB_STATE_RUNNING)
        yield _status(request.job_id)

    def GetJobHistory(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("GetJobHistory")
        return orchestrator_pb2.JobHistory(steps=[orchestrator_pb2.StepRecord(agent="sender", step=0, version=1)])

    def EvaluateJob(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("EvaluateJob")
        return orchestrator_pb2.EvaluateJobResponse(round_id="d1")


@pytest.fixture
def orchestrator() -> Iterator[tuple[str, RecordingOrchestrator]]:
    servicer = RecordingOrchestrator()  # type: ignore[abstract]  # worker RPCs stay UNIMPLEMENTED
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


def _spec() -> dict[str, Any]:
    spec = small_job()
    for agent in spec["agents"]:
        agent["model"] = "/models/tiny"  # the SDK validates the spec; it does not open the model
    parsed: dict[str, Any] = json.loads(parse_job_spec(spec).to_json())
    return parsed


def _args(rpc: str) -> tuple[Any, ...]:
    return {"SubmitJob": (_spec(),), "ListJobs": ()}.get(rpc, ("job-1",))


def test_descriptor_rpcs_are_all_classified() -> None:
    rpcs = {method.name for method in SERVICE.methods}
    assert not set(PUBLIC_RPCS) & WORKER_RPCS
    assert rpcs == set(PUBLIC_RPCS) | WORKER_RPCS, "a new Orchestrator RPC: add it to the SDK or to WORKER_RPCS"
    streaming = {method.name for method in SERVICE.methods if method.server_streaming}
    assert streaming & set(PUBLIC_RPCS) == {"WatchJob"}


@pytest.mark.parametrize("rpc", sorted(PUBLIC_RPCS))
def test_every_public_rpc_has_a_client_and_async_client_method(rpc: str) -> None:
    name = PUBLIC_RPCS[rpc]
    sync_method, async_method = getattr(Client, name, None), getattr(AsyncClient, name, None)
    assert callable(sync_method) and callable(async_method), f"{rpc}: Client.{name} / AsyncClient.{name} missing"
    streaming = SERVICE.methods_by_name[rpc].server_streaming
    if streaming:
        assert inspect.isasyncgenfunction(async_method) and inspect.isgeneratorfunction(sync_method)
    else:
        assert inspect.iscoroutinefunction(async_method) and not inspect.iscoroutinefunction(sync_method)
    required = [
        [p.name for p in inspect.signature(m).parameters.values() if p.default is inspect.Parameter.empty]
        for m in (sync_method, async_method)
    ]
    assert required[0] == required[1], f"{name}: Client and AsyncClient take different required arguments"
    assert sync_method.__doc__ and async_method.__doc__


@pytest.mark.parametrize("rpc", sorted(PUBLIC_RPCS))
def test_client_method_issues_its_rpc(rpc: str, orchestrator: tuple[str, RecordingOrchestrator]) -> None:
    address, servicer = orchestrator
    with Client(address, timeout_s=10) as client:
        result: Any = getattr(client, PUBLIC_RPCS[rpc])(*_args(rpc))
        if inspect.isgenerator(result):
            states = [cast(JobInfo, info).state.name for info in result]
            assert states == ["RUNNING", "SUCCEEDED"]
    assert servicer.calls == [rpc]


@pytest.mark.parametrize("rpc", sorted(PUBLIC_RPCS))
async def test_async_client_method_issues_its_rpc(rpc: str, orchestrator: tuple[str, RecordingOrchestrator]) -> None:
    address, servicer = orchestrator
    async with AsyncClient(address, timeout_s=10) as client:
        method = getattr(client, PUBLIC_RPCS[rpc])
        if inspect.isasyncgenfunction(method):
            states = [info.state.name async for info in method(*_args(rpc))]
            assert states == ["RUNNING", "SUCCEEDED"]
        else:
            await method(*_args(rpc))
    assert servicer.calls == [rpc]


def test_worker_rpcs_are_not_sdk_methods() -> None:
    public_names = set(dir(Client)) | set(dir(AsyncClient))
    for rpc in WORKER_RPCS:
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in rpc).lstrip("_")
        assert rpc not in public_names and snake not in public_names, rpc


@pytest.mark.timeout(60)
def test_a_plain_script_with_the_sync_client_exits_without_tracebacks() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("sync_client_script.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["final", "SUCCEEDED", "seen", "4"] * 2 + ["done"]
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr


def test_submit_checks_the_environment_before_reaching_the_cluster() -> None:
    from flexmarl.errors import InvalidArgument

    spec = small_job()
    spec["environment"]["entrypoint"] = "examples.signalling.env:SignalingGame"  # a typo
    with Client("127.0.0.1:1") as client, pytest.raises(InvalidArgument, match="environment.entrypoint"):
        client.submit(spec)


class VersionedOrchestrator(RecordingOrchestrator):
    """A finished job whose sender reached v5 under a keep-last-2, keep-every-2 policy."""

    def GetJob(self, request: Any, context: Any) -> Any:  # noqa: N802
        spec = _spec()
        spec["checkpoint"] = {"keep_last": 2, "keep_every": 2, "keep_states": 1}
        status = _status(request.job_id)
        status.spec_json = json.dumps(spec)
        status.agents.add(agent="sender", step=5, version=5, initial_weights_uri="file:///w/sender/warm")
        status.agents.add(agent="receiver", step=0, version=0)
        return status

    def GetJobHistory(self, request: Any, context: Any) -> Any:  # noqa: N802
        return orchestrator_pb2.JobHistory(steps=[
            orchestrator_pb2.StepRecord(agent="sender", step=v - 1, version=v, reward_mean=v / 10,
                                        weights_uri=f"file:///w/sender/v{v}") for v in range(1, 6)])


def test_versions_list_what_the_policy_keeps_and_a_pruned_download_says_so(tmp_path: Any) -> None:
    from flexmarl.errors import NotFound

    servicer = VersionedOrchestrator()  # type: ignore[abstract]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}") as client:
            versions = client.versions("job-1")
            kept = [(v.agent, v.version) for v in versions if v.retained]
            assert kept == [("sender", 0), ("sender", 2), ("sender", 4), ("sender", 5), ("receiver", 0)]
            assert [v.version for v in versions if v.agent == "sender"] == [0, 1, 2, 3, 4, 5]
            assert client._run(client._async.weights_uri("job-1", "sender", 4)) == "file:///w/sender/v4"
            # Version 0: the sender's published warm start; the receiver (no warm start) is the spec's model.
            zero = {v.agent: v.weights_uri for v in versions if v.version == 0}
            assert zero["sender"] == "file:///w/sender/warm"
            assert zero["receiver"] == _spec()["agents"][1]["model"] != zero["sender"]
            assert client._run(client._async.weights_uri("job-1", "sender", 0)) == "file:///w/sender/warm"
            with pytest.raises(NotFound, match="pruned by the checkpoint policy"):
                client.download_weights("job-1", "sender", 3, tmp_path / "v3")
            with pytest.raises(NotFound, match="no committed version 9"):
                client.download_weights("job-1", "sender", 9, tmp_path / "v9")
    finally:
        server.stop(0)


def test_history_and_versions_print_as_text_and_csv(capsys: pytest.CaptureFixture[str]) -> None:
    from flexmarl import cli

    servicer = VersionedOrchestrator()  # type: ignore[abstract]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        assert cli.main(["history", "job-1", "--csv", "--address", address]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split(",") == list(cli.HISTORY_FIELDS)
        assert [line.split(",")[:4] for line in lines[1:]] == [
            ["sender", str(v - 1), str(v), str(v / 10)] for v in range(1, 6)]
        # records written before orchestratord recorded the unshaped return still read: no return, not a made-up 0
        assert lines[0].split(",")[4] == "return_mean" and {line.split(",")[4] for line in lines[1:]} == {""}
        # nor failure figures (an empty column, not 0)
        assert lines[0].split(",")[13] == "episodes_failed" and {line.split(",")[13] for line in lines[1:]} == {""}
        assert cli.main(["history", "job-1", "--agent", "receiver", "--csv", "--address", address]) == 0
        assert capsys.readouterr().out.splitlines() == [",".join(cli.HISTORY_FIELDS)]
        assert cli.main(["history", "job-1", "--address", address]) == 0
        assert "0.500" in capsys.readouterr().out  # the table: v5's reward
        assert cli.main(["versions", "job-1", "--json", "--address", address]) == 0
        kept = [(v["agent"], v["version"]) for v in json.loads(capsys.readouterr().out) if v["retained"]]
        assert kept == [("sender", 0), ("sender", 2), ("sender", 4), ("sender", 5), ("receiver", 0)]
    finally:
        server.stop(0)


def test_watch_off_a_terminal_prints_failed_rewards_as_they_change_and_the_given_up_tasks_at_the_end(
        capsys: pytest.CaptureFixture[str]) -> None:
    from flexmarl import cli

    def snapshot(state: int, done: int, failed: int, given_up: int) -> JobInfo:
        return JobInfo.from_proto(orchestrator_pb2.JobStatus(
            job_id="job-1", state=state, tasks_done=done, tasks_total=8, episodes_failed=failed,
            tasks_given_up=given_up, last_episode_failure=f"task job-1/b1/t2 given up: {failed} failed"))

    class Watching:
        def watch(self, job_id: str) -> Iterator[JobInfo]:
            running = orchestrator_pb2.JOB_STATE_RUNNING
            yield from (snapshot(running, 1, 0, 0), snapshot(running, 2, 1, 0), snapshot(running, 3, 1, 0),
                        snapshot(running, 5, 5, 1), snapshot(orchestrator_pb2.JOB_STATE_SUCCEEDED, 6, 10, 2))

    final = cli._watch_lines(Watching(), "job-1", quiet=False)
    assert final is not None and final.tasks_given_up == 2
    assert capsys.readouterr().out.splitlines() == [
        "job-1 failed rewards: 1 episodes dropped, 0 tasks given up; last: task job-1/b1/t2 given up: 1 failed",
        "job-1 failed rewards: 5 episodes dropped, 1 tasks given up; last: task job-1/b1/t2 given up: 5 failed",
        "job-1 failed rewards: 10 episodes dropped, 2 tasks given up; last: task job-1/b1/t2 given up: 10 failed",
        "job-1 succeeded tasks 6/8 (2 given up)"]
