"""`flexmarl submit` / `watch` in-process: failures name the job's state and error, the cluster is reached
before any model is built, the environment is checked before sending, model building is quiet.

The cluster side is a real gRPC server answering the public job API with fixed replies (what
the CLI does with an answer is under test here, not orchestratord).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import socket
import sys
import textwrap
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from cli_support import small_job, write_job

from flexmarl.cli import main
from flexmarl.entrypoints import load_entrypoint, loaded_digest, source_digest
from flexmarl.jobspec import parse_job_spec
from flexmarl.preflight import config_problems, preflight_problems
from flexmarl.tiny import build_tiny_checkpoint
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

pytestmark = pytest.mark.timeout(120)

FAILURE = "environment.entrypoint: cannot load 'examples.signalling.env:SignalingGame': No module named ..."
#: One small tiny:// checkpoint for both agents: built in well under a second.
SMALL_TINY = "tiny://qwen2?seed=1&num_layers=1&hidden_size=32&num_heads=2&num_kv_heads=1&head_dim=16" \
             "&intermediate_size=32"


class FailingOrchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    """Accepts every job; every job it is asked about has FAILED with :data:`FAILURE`."""

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def SubmitJob(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.submitted.append(request.spec_json)
        return orchestrator_pb2.SubmitJobResponse(job_id="signaling-1")

    def ListJobs(self, request: Any, context: Any) -> Any:  # noqa: N802
        return orchestrator_pb2.ListJobsResponse()

    def WatchJob(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        yield orchestrator_pb2.JobStatus(job_id=request.job_id, name="signaling",
                                         state=orchestrator_pb2.JOB_STATE_RUNNING)
        yield orchestrator_pb2.JobStatus(job_id=request.job_id, name="signaling",
                                         state=orchestrator_pb2.JOB_STATE_FAILED, error=FAILURE)


@pytest.fixture
def orchestrator() -> Iterator[tuple[str, FailingOrchestrator]]:
    servicer = FailingOrchestrator()  # type: ignore[abstract]  # other RPCs stay UNIMPLEMENTED
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


@pytest.fixture(autouse=True)
def no_cluster_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEXMARL_ORCHESTRATOR", raising=False)
    monkeypatch.delenv("FLEXMARL_ETCD_ENDPOINTS", raising=False)


def _job_file(tmp_path: Path, model: str = SMALL_TINY, **overrides: Any) -> Path:
    spec = small_job(**overrides)
    for agent in spec["agents"]:
        agent["model"] = model
    path: Path = write_job(tmp_path / "job.yaml", spec)
    return path


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- a job that ends badly


def test_watch_of_a_failed_job_prints_its_state_and_error(orchestrator: tuple[str, FailingOrchestrator],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    address, _ = orchestrator
    assert main(["watch", "signaling-1", "--address", address]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"flexmarl watch: job signaling-1 FAILED: {FAILURE}"


def test_submit_watch_of_a_failed_job_prints_its_state_and_error_and_builds_quietly(
    orchestrator: tuple[str, FailingOrchestrator], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # quiet because the CLI asks, not because of the env
    address, servicer = orchestrator
    code = main(["submit", str(_job_file(tmp_path)), "--watch", "--address", address,
                 "--run-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 1
    assert err.strip() == f"flexmarl submit: job signaling-1 FAILED: {FAILURE}"  # no progress bars either
    assert out.splitlines()[0] == "signaling-1"
    assert len(servicer.submitted) == 1
    assert (tmp_path / "run" / "models").is_dir()  # the tiny model was built, then sent as a path
    assert str((tmp_path / "run" / "models").resolve()) in servicer.submitted[0]


# ---------------------------------------------------------------- no cluster: nothing is built


def test_submit_without_a_cluster_file_fails_before_building_models(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["submit", str(_job_file(tmp_path)), "--run-dir", str(run_dir)]) == 3
    assert capsys.readouterr().err.startswith("flexmarl submit: no cluster: pass --address or --etcd")
    assert not (run_dir / "models").exists()


def test_submit_to_an_unreachable_cluster_fails_before_building_models(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    code = main(["submit", str(_job_file(tmp_path)), "--run-dir", str(run_dir),
                 "--address", f"127.0.0.1:{_closed_port()}"])
    assert code == 3
    assert capsys.readouterr().err.startswith("flexmarl submit: cannot reach the cluster: ")
    assert not (run_dir / "models").exists()


# ---------------------------------------------------------------- preflight


def _spec(**environment: Any) -> Any:
    spec = small_job()
    spec["environment"] = {**spec["environment"], **environment}
    for agent in spec["agents"]:
        agent["model"] = "/models/tiny"
    return spec


def _problems(spec: dict[str, Any]) -> list[str]:
    return preflight_problems(parse_job_spec(spec))


def test_preflight_accepts_the_example() -> None:
    assert _problems(_spec()) == []


@pytest.mark.parametrize(("environment", "expected"), [
    ({"entrypoint": "examples.signalling.env:SignalingGame"},
     "environment.entrypoint: cannot load 'examples.signalling.env:SignalingGame': No module named "
     "'examples.signalling'"),
    ({"entrypoint": "examples.signaling.env:SignallingGame"},
     "environment.entrypoint: cannot load 'examples.signaling.env:SignallingGame': module "
     "'examples.signaling.env' has no attribute 'SignallingGame'"),
    ({"entrypoint": "examples.signaling.env:task_rng"},
     "environment.entrypoint: 'examples.signaling.env:task_rng' is not an Environment subclass"),
    ({"config": {"num_objects": 99}},
     "environment.config: bad config for environment 'examples.signaling.env:SignalingGame': "
     "num_objects must be in 2..10"),
])
def test_preflight_names_the_field_of_an_environment_that_does_not_load(environment: dict[str, Any],
                                                                         expected: str) -> None:
    assert _problems(_spec(**environment)) == [expected]


def test_preflight_refuses_a_typo_in_an_examples_config() -> None:
    """The examples declare their config as parameters, so a misspelt key is refused before submit."""
    assert _problems(_spec(config={"num_object": 4})) == [
        "environment.config.num_object: not a parameter of 'examples.signaling.env:SignalingGame' (it takes "
        "num_objects, shuffle_candidates, message_tokens, sender_reward, answer_top_logprobs)"]


EXAMPLE_JOBS = sorted((Path(__file__).resolve().parents[2] / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("job", EXAMPLE_JOBS, ids=lambda p: str(p.relative_to(p.parents[2])))
def test_every_example_environment_declares_its_config_and_its_job_matches(job: Path) -> None:
    environment = yaml.safe_load(job.read_text())["environment"]
    target = load_entrypoint(environment["entrypoint"], "environment")
    parameters = inspect.signature(target).parameters.values()
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters), "config as **kwargs: unchecked"
    assert config_problems(environment["entrypoint"], target, environment.get("config") or {}) == []


def test_preflight_agents_must_be_the_environments() -> None:
    spec = _spec()
    spec["agents"][1]["name"] = "listener"
    assert _problems(spec) == [
        "agents: environment 'examples.signaling.env:SignalingGame' plays agents ['sender', 'receiver']; "
        "the job has none named ['receiver']",
        "agents[1].name: 'listener' is not an agent of environment 'examples.signaling.env:SignalingGame' "
        "(it plays ['sender', 'receiver'])",
    ]


def test_preflight_imports_from_the_current_directory_like_the_daemons(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's module beside the job file: imported from the current directory; its own errors are one line."""
    name = f"user_game_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        from flexmarl.episode import Environment, Task

        class Game(Environment):
            agents = ("sender", "receiver")

            def task(self, index, seed):
                return Task(index=index, seed=seed)

            async def episode(self, ctx, task):
                pass

        class Broken(Game):
            def __init__(self, **config):
                raise RuntimeError("no dataset at /data/games")
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert _problems(_spec(entrypoint=f"{name}:Game", config={})) == []
        assert _problems(_spec(entrypoint=f"{name}:Broken", config={})) == [
            f"environment.entrypoint: loading '{name}:Broken' raised RuntimeError: no dataset at /data/games"]
        assert str(tmp_path) not in sys.path  # the directory was on sys.path only while loading
    finally:
        sys.modules.pop(name, None)


def test_submit_sends_the_digest_of_the_code_it_checked_and_refuses_a_module_edited_since_its_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, orchestrator: tuple[str, FailingOrchestrator],
        capsys: pytest.CaptureFixture[str]) -> None:
    """rolloutd compares the digest with the module it runs; the preflight must not stamp code it did not run."""
    address, servicer = orchestrator
    name = f"edited_game_{tmp_path.name.replace('-', '_')}"
    source = tmp_path / f"{name}.py"
    source.write_text(textwrap.dedent("""
        from examples.signaling.env import SignalingGame

        class Game(SignalingGame):
            pass
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    job = _job_file(tmp_path, environment={"entrypoint": f"{name}:Game", "config": {}})
    argv = ["submit", str(job), "--address", address, "--run-dir", str(tmp_path / "run")]
    try:
        assert main(argv) == 0
        sent = json.loads(servicer.submitted[-1])["environment"]
        assert sent["code_digest"] == "sha256:" + hashlib.sha256(source.read_bytes()).hexdigest()
        assert loaded_digest(name) == sent["code_digest"]

        source.write_text(source.read_text() + "\n# edited after the import\n")
        assert source_digest(name) != loaded_digest(name) == sent["code_digest"]  # the old code still runs here
        capsys.readouterr()
        assert main(argv) == 2
        assert capsys.readouterr().err.strip() == (
            f"flexmarl submit: {job}: environment.entrypoint: {name} was edited after this process imported it; "
            "the check ran the old code (start a new Python process to check and submit the edited one)")
        assert len(servicer.submitted) == 1

        assert main([*argv, "--no-preflight"]) == 0  # nothing checked, nothing compared
        assert json.loads(servicer.submitted[-1])["environment"]["code_digest"] == ""
    finally:
        sys.modules.pop(name, None)


def test_submit_runs_preflight_before_reaching_the_cluster(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    job = _job_file(tmp_path, environment={"entrypoint": "examples.signalling.env:SignalingGame", "config": {}})
    run_dir = tmp_path / "run"
    assert main(["submit", str(job), "--run-dir", str(run_dir)]) == 2  # 2, not 3: no cluster was looked for
    assert capsys.readouterr().err.strip() == (
        f"flexmarl submit: {job}: environment.entrypoint: cannot load 'examples.signalling.env:SignalingGame': "
        "No module named 'examples.signalling'")
    # --no-preflight sends it as it is: here there is no cluster to send it to
    assert main(["submit", str(job), "--run-dir", str(run_dir), "--no-preflight"]) == 3
    assert not (run_dir / "models").exists()


# ---------------------------------------------------------------- quiet model building


def test_tiny_checkpoint_progress_bars_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    sizes: dict[str, Any] = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
             "intermediate_size": 32}
    build_tiny_checkpoint(tmp_path / "quiet", **sizes)
    assert capsys.readouterr().err == ""
    build_tiny_checkpoint(tmp_path / "loud", progress=True, **sizes)
    assert "Writing model shards" in capsys.readouterr().err


def test_the_local_commands_default_to_runs_local_not_the_working_directory() -> None:
    """The --run-dir action is shared by every subcommand: a default one of them sets must not leak to the others."""
    from flexmarl import cli

    parser = cli.build_parser()
    for argv in (["up"], ["down"], ["jobs"], ["demo"]):
        assert parser.parse_args(argv).run_dir == str(cli.DEFAULT_RUN_DIR), argv
