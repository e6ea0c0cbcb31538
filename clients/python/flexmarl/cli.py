"""The ``flexmarl`` command line.

Exit codes: 0 success; 1 the operation failed (RPC error, job failed or cancelled);
2 usage error or invalid job spec; 3 cannot reach the cluster; 130 interrupted.
Errors are one line on stderr (a job spec prints one line per problem).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from flexmarl.cluster import LaunchError
from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable
from flexmarl.jobspec import MAX_EVAL_SAMPLES_PER_TASK
from flexmarl.plots import plot_history

if TYPE_CHECKING:
    from flexmarl.jobspec import JobSpec

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130

DEFAULT_RUN_DIR = Path("runs") / "local"
REPO_ROOT = Path(__file__).resolve().parents[3]


class CliError(Exception):
    """A failure to report as one line with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = code


#: Lines of a failed daemon's log that `flexmarl up` prints (its own cause is usually among them).
LAUNCH_LOG_LINES = 15


def _did_not_start(exc: LaunchError, run_dir: str | Path) -> CliError:
    """What a cluster that failed to start shows: the cause, the failing daemon's last log lines, the logs."""
    first, _, output = str(exc).partition("\n")
    lines = [line for line in output.splitlines() if line.strip()][-LAUNCH_LOG_LINES:]
    cause = first.removesuffix("; last output:")
    shown = "; the last lines of its log:" + "".join(f"\n  | {line}" for line in lines) if lines else ""
    return CliError(f"cluster did not start: {cause}{shown}\n(logs in {run_dir})")



class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


# ---------------------------------------------------------------- helpers


_TINY_PARAMETERS = ("seed", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size")
#: Boolean tiny:// parameters (0 or 1): URI name -> build_tiny_checkpoint argument.
_TINY_FLAGS = {"tie": "tie_word_embeddings"}


def tiny_models(spec: dict[str, Any], models_dir: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The tiny checkpoints a spec's ``tiny://`` model URIs name: URI -> (directory, builder kwargs).

    Checks every URI without building anything; raises InvalidArgument naming the agent's field.
    """
    from flexmarl.tiny import SUPPORTED_ARCHS

    plans: dict[str, tuple[Path, dict[str, Any]]] = {}
    for agent in spec.get("agents", []):
        key = _model_key(agent)
        model = str(agent.get(key, ""))
        if not model.startswith("tiny://"):
            continue
        where = f"agents[{agent.get('name')}].{key}"
        parsed = urllib.parse.urlparse(model)
        params = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query, keep_blank_values=True).items()}
        arch = parsed.netloc or "qwen2"
        if arch not in SUPPORTED_ARCHS:
            raise InvalidArgument(
                f"{where}: unknown tiny:// architecture {arch!r} (one of {', '.join(SUPPORTED_ARCHS)})"
            )
        kwargs: dict[str, Any] = {"arch": arch}
        for key, value in params.items():
            if key in _TINY_FLAGS:
                if value not in ("0", "1"):
                    raise InvalidArgument(f"{where}: tiny:// parameter {key} must be 0 or 1, got {value!r}")
                kwargs[_TINY_FLAGS[key]] = value == "1"
                continue
            if key not in _TINY_PARAMETERS:
                raise InvalidArgument(f"{where}: unknown tiny:// parameter {key!r}")
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise InvalidArgument(f"{where}: tiny:// parameter {key} must be an integer, got {value!r}") from None
        plans[model] = (models_dir / (f"{arch}-" + "-".join(f"{k}{v}" for k, v in sorted(params.items()))), kwargs)
    return plans


def materialize_models(spec: dict[str, Any], models_dir: Path, progress: bool = False) -> dict[str, Any]:
    """Replaces ``tiny://<arch>?seed=N&...`` model URIs with tiny checkpoints built on disk.

    A checkpoint already under models_dir is reused. ``progress`` shows transformers' progress
    bars while a checkpoint is written (quiet by default).
    """
    from flexmarl.tiny import build_tiny_checkpoint

    plans = tiny_models(spec, models_dir)
    out: dict[str, Any] = json.loads(json.dumps(spec))
    for agent in out.get("agents", []):
        key = _model_key(agent)
        plan = plans.get(str(agent.get(key, "")))
        if plan is None:
            continue
        target, kwargs = plan
        if not (target / "config.json").exists():
            try:
                build_tiny_checkpoint(target, progress=progress, **kwargs)
            except ValueError as exc:  # sizes the builder rejects (non-positive, heads not divisible)
                raise InvalidArgument(f"agents[{agent.get('name')}].{key}: {exc}") from None
        agent[key] = str(target.resolve())
    return out


def _model_key(agent: dict[str, Any]) -> str:
    """The key a raw agent names its model under: ``model``, or ``base`` (a LoRA agent's other spelling)."""
    return "base" if "base" in agent and "model" not in agent else "model"


def _read_spec_file(path: str, models_dir: Path) -> tuple[dict[str, Any], JobSpec]:
    """Reads and validates a job file (tiny:// URIs included) without building models: (raw spec, JobSpec)."""
    import yaml

    from flexmarl.jobspec import parse_job_spec, resolve_dataset_paths

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise CliError(f"{path}: cannot read: {exc.strerror}", EXIT_USAGE) from None
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: not valid YAML/JSON: {str(exc).splitlines()[0]}", EXIT_USAGE) from None
    if not isinstance(raw, dict):
        raise CliError(f"{path}: a job spec must be a mapping", EXIT_USAGE)
    raw = resolve_dataset_paths(raw, Path(path).parent)  # a job file's task files are relative to it
    try:
        spec = parse_job_spec(raw)
        tiny_models(raw, models_dir)
    except InvalidArgument as exc:
        raise _spec_error(path, exc) from None
    return raw, spec


def _spec_error(path: str, exc: InvalidArgument) -> CliError:
    """Exit 2 with one line per problem, each prefixed by the job file."""
    return CliError("\n".join(f"{path}: {line}" for line in str(exc).splitlines()), EXIT_USAGE)


def _materialize_spec(path: str, raw: dict[str, Any], models_dir: Path, progress: bool) -> dict[str, Any]:
    """The validated spec with its tiny:// models built under models_dir, as JSON-ready data."""
    from flexmarl.jobspec import parse_job_spec

    try:
        return parse_job_spec(materialize_models(raw, models_dir, progress)).model_dump(mode="json")
    except InvalidArgument as exc:
        raise _spec_error(path, exc) from None


def _load_spec_file(path: str, models_dir: Path, progress: bool = False) -> dict[str, Any]:
    """Reads and validates a job file; tiny:// models are built under models_dir."""
    raw, _ = _read_spec_file(path, models_dir)  # report spec problems before building any model
    return _materialize_spec(path, raw, models_dir, progress)


def _preflight(path: str, spec: JobSpec) -> str:
    """Exit 2 with one line per problem when the job's environment does not load or fit its agents.

    Returns the ``environment.code_digest`` of the code checked (:func:`flexmarl.preflight.stamped`).
    """
    from flexmarl.preflight import preflight_problems, stamped

    problems = preflight_problems(spec)
    if problems:
        raise CliError("\n".join(f"{path}: {line}" for line in problems), EXIT_USAGE)
    return stamped(spec).environment.code_digest


def _connection(args: argparse.Namespace) -> tuple[str, str, str, dict[str, str]]:
    """(address, etcd endpoints, prefix, local settings) from flags, env, or the local cluster file.

    The local settings are a secure local cluster's TLS, token and etcd options from its cluster
    file (`flexmarl up --secure`), when the cluster is found through the run dir (no --address or
    --etcd given); flags and FLEXMARL_* variables still win over them. Empty otherwise.
    """
    from flexmarl.localcluster import read_cluster_file

    address = args.address or os.environ.get("FLEXMARL_ORCHESTRATOR", "")
    etcd = args.etcd or os.environ.get("FLEXMARL_ETCD_ENDPOINTS", "")
    prefix = args.etcd_prefix
    local: dict[str, str] = {}
    if not address and not etcd:
        try:
            data = read_cluster_file(Path(args.run_dir))
        except LaunchError:
            raise CliError(
                f"no cluster: pass --address or --etcd, or start one with `flexmarl up` (looked in {args.run_dir})",
                EXIT_UNREACHABLE,
            ) from None
        etcd, prefix = str(data["etcd_endpoint"]), str(data.get("etcd_prefix", prefix))
        local = {str(k): str(v) for k, v in (data.get("etcd_tls") or {}).items()}
        if tls := data.get("tls") or {}:
            local.update(tls_ca=str(tls["ca"]), token_file=str(tls["token_file"]))
    return address, etcd, prefix, local


def _client(args: argparse.Namespace) -> Any:
    from flexmarl.client import Client

    address, etcd, prefix, local = _connection(args)

    def option(name: str) -> str:
        return str(getattr(args, name, "") or os.environ.get(f"FLEXMARL_{name.upper()}", "") or local.get(name, ""))

    from flexmarl.config import ConfigError
    from flexmarl.registry import EtcdSecurity

    try:
        etcd_security = EtcdSecurity.from_files(
            ca=option("etcd_ca"), cert=option("etcd_cert"), key=option("etcd_key"),
            username=option("etcd_username"), password_file=option("etcd_password_file"),
            server_name=option("etcd_server_name"))
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    return Client(address, etcd_endpoints=etcd, etcd_prefix=prefix, tls_ca=option("tls_ca"),
                  tls_cert=option("tls_cert"), tls_key=option("tls_key"), token_file=option("token_file"),
                  etcd_security=etcd_security)


def _console() -> Any:
    """A rich console; wide enough for the tables when output is not a terminal (logs, CI)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120)


def _fmt_state(state: Any) -> str:
    return str(state.name).lower()


def _fmt_failed(record: Any) -> str:
    """A step's dropped episodes and given-up tasks (``3/1``); "-" for a record written before they were recorded."""
    if record.episodes_failed is None:
        return "-"
    return f"{record.episodes_failed}/{record.tasks_given_up or 0}"


def _fmt_return(value: float | None) -> str:
    """A reported episode return; "-" for a history record written before orchestratord recorded it."""
    return "-" if value is None else f"{value:.3f}"


def _fmt_tasks(info: Any) -> str:
    """``tasks 6/8 (2 given up)``: the given-up tasks named, so that a finished job never looks unfinished."""
    given_up = f" ({info.tasks_given_up} given up)" if info.tasks_given_up else ""
    return f"tasks {info.tasks_done}/{info.tasks_total}{given_up}"


def _failure_line(info: Any) -> str:
    """The job's failed rewards (docs/workflows.md, "When a reward fails"), with the latest reason."""
    return (f"failed rewards: {info.episodes_failed} episodes dropped, {info.tasks_given_up} tasks given up; "
            f"last: {info.last_episode_failure}")


def _print_status(info: Any) -> None:
    from rich.table import Table

    console = _console()
    console.print(f"job [bold]{info.job_id}[/] ({info.name}): {_fmt_state(info.state)}  {_fmt_tasks(info)}")
    if info.error:
        console.print(f"error: {info.error}")
    if info.episodes_failed or info.tasks_given_up:
        console.print(_failure_line(info), markup=False)
    table = Table("agent", "step", "version", "return", "trained reward", "tokens/s", "staleness", "step s", "slot")
    for a in info.agents:
        table.add_row(a.agent, f"{a.step}/{a.total_steps}", str(a.version), f"{a.return_mean:.3f}",
                      f"{a.reward_mean:.3f}",
                      f"{a.tokens_per_s:.0f}", f"{a.staleness_mean:.2f}", f"{a.step_seconds:.2f}", a.slot_id or "-")
    console.print(table)


def _outcome(job_id: str, final: Any) -> int:
    """EXIT_OK when the job succeeded; else a CliError that names its state and error."""
    if final is None:
        raise CliError(f"job {job_id}: the status stream ended before the job did")
    if final.state.name != "SUCCEEDED":
        raise CliError(f"job {job_id} {final.state.name}" + (f": {final.error}" if final.error else ""))
    return EXIT_OK


def watch_job(client: Any, job_id: str, quiet: bool = False) -> Any:
    """Shows rich progress bars per agent until the job ends; returns the final snapshot.

    Not on a terminal (a log file, a pipe, a Slurm job's output) it prints one line per committed
    step instead, as it happens (progress bars there would show nothing until the job ends).
    """
    if not sys.stdout.isatty():
        return _watch_lines(client, job_id, quiet)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    final = None
    columns = (TextColumn("[bold]{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[detail]}"), TimeElapsedColumn())
    with Progress(*columns, disable=quiet, transient=False) as progress:
        bars: dict[str, Any] = {}
        for info in client.watch(job_id):
            final = info
            for a in info.agents:
                if a.agent not in bars:
                    bars[a.agent] = progress.add_task(a.agent, total=a.total_steps, detail="")
                detail = (f"return {a.return_mean:.3f}  trained reward {a.reward_mean:.3f}  "
                          f"{a.tokens_per_s:.0f} tok/s  "
                          f"staleness {a.staleness_mean:.2f}  v{a.version}")
                progress.update(bars[a.agent], completed=a.step, detail=detail)
    if final is not None and not quiet and (final.episodes_failed or final.tasks_given_up):
        _console().print(f"{_fmt_tasks(final)}; {_failure_line(final)}", markup=False)
    return final


def _watch_lines(client: Any, job_id: str, quiet: bool) -> Any:
    """watch_job off a terminal: a line per agent step and the final state, flushed as they come."""
    final = None
    shown: dict[str, int] = {}
    failures = (0, 0)
    for info in client.watch(job_id):
        final = info
        if not quiet and (info.episodes_failed, info.tasks_given_up) != failures:
            failures = (info.episodes_failed, info.tasks_given_up)
            print(f"{job_id} {_failure_line(info)}", flush=True)
        for a in info.agents:
            if not quiet and shown.get(a.agent, -1) != a.step:
                shown[a.agent] = a.step
                print(f"{job_id} {a.agent} step {a.step}/{a.total_steps} v{a.version} return {a.return_mean:.3f} "
                      f"trained_reward {a.reward_mean:.3f} "
                      f"{a.tokens_per_s:.0f} tok/s staleness {a.staleness_mean:.2f}", flush=True)
    if final is not None and not quiet:
        print(f"{job_id} {final.state.name.lower()} {_fmt_tasks(final)}", flush=True)
    return final


# ---------------------------------------------------------------- commands


def cmd_up(args: argparse.Namespace) -> int:
    """Starts a local cluster; stays in the foreground until Ctrl-C unless --detach, restarting crashed daemons."""
    from flexmarl.localcluster import DaemonSupervisor, GaveUp, LocalCluster, LocalClusterConfig, RestartPolicy

    cluster = LocalCluster(LocalClusterConfig(
        run_dir=Path(args.run_dir), rollout_workers=args.rollout_workers, engine_replicas=args.engine_replicas,
        trainer_workers=args.trainer_workers, trainer_slots=args.trainer_slots, persistent=True,
        secure=args.secure, etcd_members=args.etcd_members,
    ))
    try:
        cluster.start()
    except LaunchError as exc:
        raise _did_not_start(exc, args.run_dir) from None
    print(f"local cluster up: etcd {cluster.etcd_endpoint}, run dir {cluster.run_dir}")
    if cluster.restored:
        print("  state of the previous run restored (its jobs are back); `flexmarl down --wipe` deletes it")
    for name, proc in cluster.daemons.items():
        print(f"  {name:<14} {proc.address:<22} metrics :{proc.metrics_port}  log {proc.log_path}")
    if args.detach:
        print("detached (a crashed daemon is not restarted); stop it with `flexmarl down`")
        return EXIT_OK
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    supervisor = DaemonSupervisor(cluster.daemons, RestartPolicy(max_restarts=args.max_restarts),
                                  on_restart=lambda name: cluster.write_cluster_file())
    try:
        while not stop.wait(0.5):
            for line in supervisor.check():
                print(line, flush=True)
    except GaveUp as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping local cluster")
        cluster.stop()
    return EXIT_OK


def cmd_down(args: argparse.Namespace) -> int:
    """Stops a detached local cluster; keeps its jobs and data unless --wipe."""
    from flexmarl.localcluster import read_cluster_file, stop_from_file, wipe_state

    run_dir = Path(args.run_dir)
    try:
        read_cluster_file(run_dir)
    except LaunchError as exc:
        if not args.wipe:
            raise CliError(str(exc), EXIT_UNREACHABLE) from None
    else:
        print(f"stopped {stop_from_file(run_dir)} processes")
    if args.wipe:
        try:
            wiped = wipe_state(run_dir)
        except LaunchError as exc:
            raise CliError(str(exc)) from None
        print(f"deleted {', '.join(str(p) for p in wiped)}" if wiped else f"no cluster data in {run_dir}")
    return EXIT_OK


def cmd_submit(args: argparse.Namespace) -> int:
    """Validates, checks against its environment and submits a job file."""
    models_dir = Path(args.run_dir) / "models"
    raw, spec = _read_spec_file(args.job_file, models_dir)
    code_digest = "" if args.no_preflight else _preflight(args.job_file, spec)
    with _client(args) as client:
        if tiny_models(raw, models_dir):
            client.list_jobs()  # reach the cluster before spending seconds on building models
        materialized = _materialize_spec(args.job_file, raw, models_dir, args.verbose)
        if code_digest:
            materialized["environment"]["code_digest"] = code_digest
        job_id = client.submit(materialized, job_id=args.job_id,
                               preflight=False,  # checked above (or skipped with --no-preflight)
                               resume_from=args.resume_from)
        print(job_id)
        if args.watch:
            return _outcome(job_id, watch_job(client, job_id))
    return EXIT_OK


def cmd_resume(args: argparse.Namespace) -> int:
    """Starts a job from the retained checkpoints of an earlier one (its own spec, or --spec FILE)."""
    if args.spec:
        args.job_file, args.resume_from = args.spec, args.source
        return cmd_submit(args)
    with _client(args) as client:
        job_id = client.resume(args.source, job_id=args.job_id)
        print(job_id)
        if args.watch:
            return _outcome(job_id, watch_job(client, job_id))
    return EXIT_OK


def cmd_watch(args: argparse.Namespace) -> int:
    """Shows progress until the job ends."""
    with _client(args) as client:
        final = watch_job(client, args.job_id)
        if final is not None:
            _print_status(final)
        return _outcome(args.job_id, final)


def cmd_status(args: argparse.Namespace) -> int:
    """Prints one job's status."""
    with _client(args) as client:
        info = client.status(args.job_id)
    if args.json:
        print(json.dumps({"job_id": info.job_id, "state": info.state.name, "error": info.error,
                          "agents": [a.__dict__ for a in info.agents], "tasks_done": info.tasks_done,
                          "tasks_total": info.tasks_total, "episodes_failed": info.episodes_failed,
                          "tasks_given_up": info.tasks_given_up,
                          "last_episode_failure": info.last_episode_failure}, indent=2))
    else:
        _print_status(info)
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancels a job."""
    with _client(args) as client:
        info = client.cancel(args.job_id)
    print(f"{info.job_id}: {_fmt_state(info.state)}")
    return EXIT_OK


def cmd_jobs(args: argparse.Namespace) -> int:
    """Lists jobs."""
    from rich.table import Table

    with _client(args) as client:
        jobs = client.list_jobs()
    table = Table("job", "name", "state", "steps", "tasks")
    for job in jobs:
        steps = ", ".join(f"{a.agent} {a.step}/{a.total_steps}" for a in job.agents)
        table.add_row(job.job_id, job.name, _fmt_state(job.state), steps, _fmt_tasks(job).removeprefix("tasks "))
    _console().print(table)
    return EXIT_OK


def cmd_versions(args: argparse.Namespace) -> int:
    """Lists every version of every agent of a job, and whether its weights are still kept."""
    from rich.table import Table

    with _client(args) as client:
        versions = client.versions(args.job_id)
    if args.json:
        print(json.dumps([dataclasses.asdict(v) for v in versions], indent=2))
        return EXIT_OK
    table = Table("agent", "version", "step", "return", "trained reward", "kept", "weights")
    for v in versions:
        if v.retained or args.all:
            table.add_row(v.agent, str(v.version), "-" if v.step < 0 else str(v.step), _fmt_return(v.return_mean),
                          "-" if v.version == 0 else f"{v.reward_mean:.3f}", "yes" if v.retained else "pruned",
                          v.weights_uri if v.retained else "")
    _console().print(table)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Writes one agent version's weights to --out; --merge folds a LoRA agent's adapter into its base (HF dir)."""
    import tempfile

    from flexmarl.adapters import is_adapter_dir, merge_adapter
    from flexmarl.artifacts import local_path

    out = Path(args.out)
    if out.exists():
        raise CliError(f"--out {out}: already exists", EXIT_USAGE)
    with _client(args) as client:
        versions = [v for v in client.versions(args.job_id) if v.agent == args.agent]
        if not versions:
            raise CliError(f"job {args.job_id} has no agent {args.agent!r}", EXIT_USAGE)
        version = args.version if args.version is not None else max(v.version for v in versions if v.retained)
        if not args.merge:
            client.download_weights(args.job_id, args.agent, version, out)
            print(out)
            return EXIT_OK
        with tempfile.TemporaryDirectory(prefix="flexmarl-export-") as tmp:
            weights = client.download_weights(args.job_id, args.agent, version, Path(tmp) / "weights")
            if not is_adapter_dir(weights):
                raise CliError(f"{args.agent} v{version} is a whole model, not a LoRA adapter: export it without "
                               f"--merge", EXIT_USAGE)
            base_uri = args.base or next(v.weights_uri for v in versions if v.version == 0)
            base = local_path(base_uri) if base_uri.startswith("file://") else Path(base_uri)
            if not (base / "config.json").is_file():
                raise CliError(f"the base {base_uri!r} is not a checkpoint dir readable here: pass --base DIR",
                               EXIT_USAGE)
            merge_adapter(weights, base, out)
    print(out)
    return EXIT_OK


HISTORY_FIELDS = ("agent", "step", "version", "reward_mean", "return_mean", "loss", "grad_norm", "staleness_mean",
                  "episodes", "response_tokens", "tokens_per_s", "step_seconds", "committed_unix_ms",
                  "episodes_failed", "tasks_given_up", "first_failure", "last_failure")


def cmd_history(args: argparse.Namespace) -> int:
    """Every committed step of a job as text: a table, or CSV with --csv (one row per agent and step)."""
    import csv

    with _client(args) as client:
        history = client.history(args.job_id)
        evals = client.evaluations(args.job_id)
    if args.eval:
        return _print_evals(evals, args.agent, args.csv)
    rows = sorted(history, key=lambda r: (r.agent, r.step))
    if args.agent:
        rows = [r for r in rows if r.agent == args.agent]
    if args.csv:
        figures = sorted({name for r in rows for name in r.figures})
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow([*HISTORY_FIELDS, *figures])
        writer.writerows([*("" if (v := getattr(r, f)) is None else v for f in HISTORY_FIELDS),
                          *(r.figures.get(n, "") for n in figures)] for r in rows)
        return EXIT_OK
    from rich.table import Table

    table = Table("agent", "step", "version", "return", "trained reward", "loss", "grad norm", "kl", "clip",
                  "staleness", "episodes", "failed", "tokens/s", "step s")
    for r in rows:
        # GRPO's loss is ~0 by construction (advantages have mean 0 within a group): print its scale.
        table.add_row(r.agent, str(r.step), str(r.version), _fmt_return(r.return_mean), f"{r.reward_mean:.3f}",
                      f"{r.loss:+.3e}",
                      f"{r.grad_norm:.3f}", f"{r.figures.get('kl', 0.0):.4f}",
                      f"{r.figures.get('clip_fraction', 0.0):.3f}",
                      f"{r.staleness_mean:.2f}", str(r.episodes), _fmt_failed(r), f"{r.tokens_per_s:.0f}",
                      f"{r.step_seconds:.2f}")
    _console().print(table)
    failing = [r for r in rows if r.last_failure]
    if failing:
        last = max(failing, key=lambda r: r.committed_unix_ms)
        _console().print(f"last failed reward (step {last.step}): {last.last_failure}", markup=False)
    if evals:
        _print_evals(evals, args.agent, False)
    return EXIT_OK


def _print_evals(evals: Sequence[Any], agent: str, as_csv: bool) -> int:
    """The held-out evaluation rounds: one row per version and scope (each agent, then the team)."""
    import csv

    from flexmarl.evaluation import EVAL_ROW_FIELDS, eval_rows

    rows = [r for r in eval_rows(evals) if not agent or r["scope"] == agent]
    if as_csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(EVAL_ROW_FIELDS)
        writer.writerows([r[f] for f in EVAL_ROW_FIELDS] for r in rows)
        return EXIT_OK
    from rich.table import Table

    table = Table("round", "version", "scope", "agent v", "versions seen", "reward", "success", "pass@k", "episodes",
                  "failed tasks", title="held-out evaluation")
    for r in rows:
        table.add_row(r["round"], str(r["version"]), r["scope"], r["agent_version"], r["versions_seen"],
                      f"{r['reward_mean']:.3f}", f"{r['success']:.3f}", f"{r['pass_at_k']:.3f}", str(r["episodes"]),
                      str(r["failed_tasks"]))
    _console().print(table)
    return EXIT_OK


def _agent_versions(args: argparse.Namespace, agents: Sequence[str]) -> dict[str, int]:
    """--version V (every agent at V) or --agent-versions a=3,b=5 as agent -> version."""
    if args.version is not None and args.agent_versions:
        raise CliError("give --version or --agent-versions, not both", EXIT_USAGE)
    if args.version is not None:
        return dict.fromkeys(agents, args.version)
    versions: dict[str, int] = {}
    for item in filter(None, (args.agent_versions or "").split(",")):
        agent, sep, number = item.partition("=")
        if not sep or not number.strip().isdigit() or agent.strip() not in agents:
            raise CliError(f"--agent-versions: expected agent=version with agents {list(agents)}, got {item!r}",
                           EXIT_USAGE)
        versions[agent.strip()] = int(number)
    return versions


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluates kept versions of a job on its held-out tasks now (an on-demand round) and prints the record."""
    if args.tasks < 0 or not 0 <= args.samples <= MAX_EVAL_SAMPLES_PER_TASK:
        raise CliError(f"--tasks: must be >= 0 and --samples 0..{MAX_EVAL_SAMPLES_PER_TASK}, got {args.tasks} and "
                       f"{args.samples}", EXIT_USAGE)
    if args.version is not None and args.agent_versions:
        raise CliError("give --version or --agent-versions, not both", EXIT_USAGE)
    if args.versions:
        return _eval_curve(args)
    with _client(args) as client:
        info = client.status(args.job_id)
        versions = _agent_versions(args, [a.agent for a in info.agents])
        try:
            round_id = client.evaluate(args.job_id, versions, args.tasks, args.dataset, args.sampling, args.samples)
        except InvalidArgument as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        print(f"evaluation {round_id} of {args.job_id} opened; waiting for its record", file=sys.stderr)
        try:
            record = client.wait_evaluation(args.job_id, round_id, args.timeout)
        except TimeoutError as exc:
            raise CliError(str(exc)) from None
    # Which tasks were played: on stderr beside a CSV (which stays one table), above the table otherwise.
    print(held_out_source(record, info.spec_json), file=sys.stderr if args.csv else sys.stdout)
    return _print_evals([record], "", args.csv)


def _eval_curve(args: argparse.Namespace) -> int:
    """--versions: one pinned round per team version (every agent at it), one after the other, in one table."""
    if args.version is not None or args.agent_versions:
        raise CliError("give --versions, or --version / --agent-versions, not both", EXIT_USAGE)
    items = [item.strip() for item in args.versions.split(",")]
    if items != ["kept"] and not all(item.isdigit() for item in items):
        raise CliError(f"--versions: expected 'kept' or versions like 0,4,8, got {args.versions!r}", EXIT_USAGE)
    with _client(args) as client:
        info = client.status(args.job_id)
        versions = client.kept_team_versions(args.job_id) if items == ["kept"] else sorted({int(v) for v in items})
        print(f"evaluating {args.job_id} at team versions {versions}: one pinned round each, one after the other",
              file=sys.stderr)
        try:  # a version not kept: FailedPrecondition, reported by main() with the policy named
            records = client.evaluate_versions(args.job_id, versions, args.tasks, args.dataset, args.timeout,
                                               args.sampling, args.samples)
        except TimeoutError as exc:
            raise CliError(str(exc)) from None
    if records:
        print(held_out_source(records[0], info.spec_json), file=sys.stderr if args.csv else sys.stdout)
    return _print_evals(records, "", args.csv)


def held_out_source(record: Any, spec_json: str) -> str:
    """One line naming the held-out tasks a round played: its task file, the job's eval split, or generated ones."""
    from flexmarl.jobspec import parse_job_spec

    tasks = f"{record.tasks} held-out tasks"
    if record.eval_file:
        return f"{tasks}: rows 0..{record.tasks - 1} of {record.eval_file} (--dataset)"
    environment = parse_job_spec(json.loads(spec_json)).environment
    dataset = environment.dataset
    if dataset is not None and dataset.eval is not None:
        return f"{tasks}: rows 0..{record.tasks - 1} of {dataset.describe('eval')} (environment.dataset.eval)"
    if dataset is not None:
        return (f"{tasks}: rows of {dataset.describe('train')} (environment.dataset.train in a held-out order: "
                f"no eval file, so not a held-out split)")
    return f"{tasks}: {environment.entrypoint} eval_task(0..{record.tasks - 1}) (generated, held-out seed stream)"


def cmd_samples(args: argparse.Namespace) -> int:
    """What an agent said in a committed step: decoded prompt and response per episode and turn, with rewards."""
    if args.count < 1:
        raise CliError(f"--count: must be >= 1, got {args.count}", EXIT_USAGE)
    with _client(args) as client:
        samples = client.samples(args.job_id, args.agent, args.step, args.count)
    if args.json:
        print(json.dumps([s.as_dict() for s in samples], indent=2))
        return EXIT_OK
    from rich.markup import escape

    console = _console()
    if not samples:
        console.print(f"no stored experiences of that step of {args.agent} (collected as garbage?)")
    for s in samples:
        console.print(f"[bold]{s.agent} step {s.step}[/]  task {escape(s.task_id)}  episode {s.sample_index}  "
                      f"turn {s.turn}  reward {s.reward:.3f}  (v{s.behavior_version}, "
                      f"{s.prompt_tokens}+{s.response_tokens} tokens)", soft_wrap=True)
        console.print(f"[dim]prompt:[/]   {escape(s.prompt)}", soft_wrap=True)
        console.print(f"[dim]response:[/] {escape(s.response)}", soft_wrap=True)
        if args.ids:
            console.print(f"[dim]prompt ids:[/]   {' '.join(map(str, s.prompt_token_ids))}", soft_wrap=True)
            console.print(f"[dim]response ids:[/] {' '.join(map(str, s.response_token_ids))}", soft_wrap=True)
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    """Prints the job file's JSON Schema (or, with --markdown, the field reference of docs/jobspec.md)."""
    from flexmarl.jobspec_reference import json_schema, markdown

    print(markdown() if args.markdown else json.dumps(json_schema(), indent=2))
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    """Writes reward and throughput curves of a job to a PNG."""
    with _client(args) as client:
        history = client.history(args.job_id)
        evals = client.evaluations(args.job_id)
        info = client.status(args.job_id)
    if not history and not evals:
        raise CliError(f"job {args.job_id} has no committed step yet")
    out = plot_history(history, Path(args.out or f"{args.job_id}.png"), f"{info.name} ({args.job_id})", evals)
    print(out)
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Local cluster + the signaling-game example + progress + plot + summary."""
    from rich.table import Table

    from flexmarl.client import Client
    from flexmarl.localcluster import LocalCluster, LocalClusterConfig

    console = _console()
    run_dir = Path(args.run_dir if args.run_dir != str(DEFAULT_RUN_DIR) else Path("runs") / "demo").resolve()
    job_file = Path(args.job_file) if args.job_file else REPO_ROOT / "examples" / "signaling" / "job.yaml"
    spec = _load_spec_file(str(job_file), run_dir / "models", args.verbose)
    if args.steps:
        spec["total_steps"] = args.steps
    console.print(f"[bold]FlexMARL demo[/]: {spec['name']} with agents "
                  f"{', '.join(a['name'] for a in spec['agents'])}; run dir {run_dir}", soft_wrap=True)
    cluster = LocalCluster(LocalClusterConfig(run_dir=run_dir, engine_replicas=args.engine_replicas,
                                              trainer_slots=args.trainer_slots))
    try:
        cluster.start()
    except LaunchError as exc:
        raise _did_not_start(exc, run_dir) from None
    started = time.monotonic()
    try:
        with Client(etcd_endpoints=cluster.etcd_endpoint) as client:
            job_id = client.submit(spec)
            console.print(f"submitted job {job_id}")
            final = watch_job(client, job_id)
            history = client.history(job_id)
    finally:
        cluster.stop()
    if final is None:
        raise CliError("the job's status stream ended early")
    png = plot_history(history, run_dir / f"{job_id}-reward.png", f"{spec['name']} ({job_id})")
    # "reward" here is the reported one: each step's mean unshaped episode return (docs/environments.md)
    table = Table("agent", "steps", "first reward", "last reward", "best reward", "tokens/s", "step s")
    for agent in sorted({r.agent for r in history}):
        rows = sorted((r for r in history if r.agent == agent), key=lambda r: r.step)
        returns = [r.return_mean for r in rows if r.return_mean is not None]
        table.add_row(agent, str(len(rows)), _fmt_return(rows[0].return_mean), _fmt_return(rows[-1].return_mean),
                      _fmt_return(max(returns, default=None)),
                      f"{sum(r.tokens_per_s for r in rows) / len(rows):.0f}",
                      f"{sum(r.step_seconds for r in rows) / len(rows):.2f}")
    console.print(table)
    console.print(f"job {_fmt_state(final.state)} in {time.monotonic() - started:.0f}s; reward curve: {png}",
                  soft_wrap=True)
    if final.state.name != "SUCCEEDED":
        raise CliError(f"job ended {_fmt_state(final.state)}: {final.error}")
    return EXIT_OK


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = _Parser(prog="flexmarl", description="FlexMARL: multi-agent RL for LLM agents.")
    common = _Parser(add_help=False)
    common.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help="local cluster directory")
    common.add_argument("--address", default="", help="orchestratord host:port (skips discovery)")
    common.add_argument("--etcd", default="", help="etcd host:port list for discovery")
    common.add_argument("--etcd-prefix", default="/flexmarl", help="etcd key prefix")
    common.add_argument("--tls-ca", default="", help="CA bundle: talk TLS, verify orchestratord [env FLEXMARL_TLS_CA]")
    common.add_argument("--tls-cert", default="", help="client certificate for mutual TLS [env FLEXMARL_TLS_CERT]")
    common.add_argument("--tls-key", default="", help="private key of --tls-cert [env FLEXMARL_TLS_KEY]")
    common.add_argument("--token-file", default="", help="file holding the bearer token [env FLEXMARL_TOKEN_FILE]")
    common.add_argument("--etcd-ca", default="", help="CA bundle: reach etcd over TLS [env FLEXMARL_ETCD_CA]")
    common.add_argument("--etcd-cert", default="", help="client certificate for etcd [env FLEXMARL_ETCD_CERT]")
    common.add_argument("--etcd-key", default="", help="private key of --etcd-cert [env FLEXMARL_ETCD_KEY]")
    common.add_argument("--etcd-username", default="", help="etcd user [env FLEXMARL_ETCD_USERNAME]")
    common.add_argument("--etcd-password-file", default="",
                        help="file holding the etcd user's password [env FLEXMARL_ETCD_PASSWORD_FILE]")
    common.add_argument("--etcd-server-name", default="",
                        help="name the etcd members' TLS certificates are checked against (default: the first "
                             "endpoint's host) [env FLEXMARL_ETCD_SERVER_NAME]")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    up = sub.add_parser("up", parents=[common], help="start a local cluster")
    up.add_argument("--rollout-workers", type=int, default=1, help="rolloutd processes")
    up.add_argument("--engine-replicas", type=int, default=2, help="embedded engine replicas of each rolloutd")
    up.add_argument("--trainer-workers", type=int, default=1, help="traind processes")
    up.add_argument("--trainer-slots", type=int, default=1, help="training slots of each traind (one agent each)")
    up.add_argument("--etcd-members", type=int, default=1, choices=(1, 3, 5),
                    help="etcd members: 3 or 5 keep a quorum when one or two die (each its own process and data)")
    up.add_argument("--detach", action="store_true", help="leave it running in the background")
    up.add_argument("--secure", action="store_true",
                    help="TLS + bearer token on every daemon, etcd with mutual TLS and auth (dev certificates in the "
                         "run dir; the CLI finds them through the cluster file); pass it again to restart the cluster")
    from flexmarl.localcluster import RestartPolicy

    up.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                    help="restarts of a crashed daemon within 5 minutes before `up` gives up (0: never restart)")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", parents=[common], help="stop a detached local cluster (its jobs stay)")
    down.add_argument("--wipe", action="store_true",
                      help="also delete the cluster's jobs and data (etcd, stored, worker dirs) in the run dir")
    down.set_defaults(func=cmd_down)

    submit = sub.add_parser("submit", parents=[common], help="submit a job file (YAML/JSON)")
    submit.add_argument("job_file")
    submit.add_argument("--job-id", default="")
    submit.add_argument("--watch", action="store_true", help="watch it until it ends")
    submit.add_argument("--no-preflight", action="store_true",
                        help="skip loading environment.entrypoint here (when only the cluster's hosts have it)")
    submit.add_argument("--verbose", action="store_true", help="show progress while building tiny:// models")
    submit.add_argument("--resume-from", default="", metavar="SRC",
                        help="continue an earlier job's retained checkpoints (see `flexmarl resume`)")
    submit.set_defaults(func=cmd_submit)

    resume = sub.add_parser(
        "resume", parents=[common],
        help="start a job from the last retained checkpoint of each agent of an earlier job (its cluster may be gone)")
    resume.add_argument("source", help="the earlier job's id (its checkpoints in stored), stored://checkpoints/JOB "
                                       "or file:///TRAIND_WORK_DIR/checkpoints/JOB")
    resume.add_argument("--spec", default="", metavar="FILE",
                        help="a job file to run instead of the earlier job's spec (same agents and model shapes)")
    resume.add_argument("--job-id", default="")
    resume.add_argument("--watch", action="store_true", help="watch it until it ends")
    resume.add_argument("--no-preflight", action="store_true", help="with --spec: skip loading the environment here")
    resume.add_argument("--verbose", action="store_true", help="with --spec: show progress while building models")
    resume.set_defaults(func=cmd_resume)

    for name, func, text in (("watch", cmd_watch, "progress bars until the job ends"),
                             ("cancel", cmd_cancel, "cancel a job")):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("job_id")
        p.set_defaults(func=func)
    status = sub.add_parser("status", parents=[common], help="one job's status")
    status.add_argument("job_id")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)
    sub.add_parser("jobs", parents=[common], help="list jobs").set_defaults(func=cmd_jobs)
    versions = sub.add_parser("versions", parents=[common],
                              help="every retained version of every agent (step, reward, where its weights are)")
    versions.add_argument("job_id")
    versions.add_argument("--all", action="store_true", help="also list versions the checkpoint policy pruned")
    versions.add_argument("--json", action="store_true")
    versions.set_defaults(func=cmd_versions)
    export = sub.add_parser("export", parents=[common],
                            help="an agent version's weights into a directory (--merge: a LoRA adapter merged into "
                                 "its base, a plain HF checkpoint)")
    export.add_argument("job_id")
    export.add_argument("--agent", required=True)
    export.add_argument("--version", type=int, default=None, help="default: the agent's latest retained version")
    export.add_argument("--merge", action="store_true", help="merge a LoRA agent's adapter into its base (needs peft)")
    export.add_argument("--base", default="", metavar="DIR",
                        help="with --merge: the base checkpoint dir (default: the agent's model in the job spec)")
    export.add_argument("--out", required=True, metavar="DIR", help="the directory to write (must not exist)")
    export.set_defaults(func=cmd_export)
    history = sub.add_parser("history", parents=[common], help="every committed step as text (--csv for CSV)")
    history.add_argument("job_id")
    history.add_argument("--agent", default="", help="only this agent")
    history.add_argument("--csv", action="store_true")
    history.add_argument("--eval", action="store_true",
                         help="the held-out evaluation rounds instead (one row per version and agent or team)")
    history.set_defaults(func=cmd_history)
    samples = sub.add_parser("samples", parents=[common],
                             help="an agent's episodes of a committed step as text (prompt, response, reward)")
    samples.add_argument("job_id")
    samples.add_argument("--agent", required=True, help="the agent whose turns to show")
    samples.add_argument("--step", type=int, default=None, help="the committed step (default: the latest)")
    samples.add_argument("--count", type=int, default=4, help="how many experiences (agent turns) to show")
    samples.add_argument("--ids", action="store_true",
                         help="also print the token ids (byte-level ids may decode to '' or U+FFFD)")
    samples.add_argument("--json", action="store_true", help="every field as JSON, the token ids included")
    samples.set_defaults(func=cmd_samples)
    schema = sub.add_parser("schema", help="the job file's JSON Schema (for editors); --markdown: the reference")
    schema.add_argument("--markdown", action="store_true")
    schema.set_defaults(func=cmd_schema)

    evaluate = sub.add_parser("eval", parents=[common],
                              help="evaluate kept versions on the job's held-out tasks now (docs/evaluation.md)")
    evaluate.add_argument("job_id")
    evaluate.add_argument("--version", type=int, default=None, help="every agent at this version")
    evaluate.add_argument("--agent-versions", default="", help="agent=version,... (others: their committed version)")
    evaluate.add_argument("--versions", default="", help="a held-out curve: one round per team version, e.g. 0,4,8, "
                          "or 'kept' (every version all agents keep)")
    evaluate.add_argument("--tasks", type=int, default=0, help="held-out tasks (0: the job's evaluation.tasks)")
    evaluate.add_argument("--dataset", default="",
                          help="held-out rows from this task file (JSONL, Parquet, save_to_disk dir) instead")
    evaluate.add_argument("--sampling", choices=["greedy", "policy"], default="",
                          help="greedy, or the agents' own sampling (default: the job's evaluation.sampling)")
    evaluate.add_argument("--samples", type=int, default=0, help="episodes per task, pass@k over them (0: the job's)")
    evaluate.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the record (each)")
    evaluate.add_argument("--csv", action="store_true")
    evaluate.set_defaults(func=cmd_eval)
    plot = sub.add_parser("plot", parents=[common], help="reward/throughput (and held-out) curves to PNG")
    plot.add_argument("job_id")
    plot.add_argument("--out", default="")
    plot.set_defaults(func=cmd_plot)

    demo = sub.add_parser("demo", parents=[common], help="local cluster + signaling game + plot")
    demo.add_argument("--job-file", default="")
    demo.add_argument("--steps", type=int, default=0, help="override total_steps")
    demo.add_argument("--engine-replicas", type=int, default=2)
    demo.add_argument("--trainer-slots", type=int, default=1)
    demo.add_argument("--verbose", action="store_true", help="show progress while building tiny:// models")
    demo.set_defaults(func=cmd_demo)
    from flexmarl import reward_time, slurm

    reward_time.add_parser(sub, common)
    slurm.add_parser(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"flexmarl {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except Unavailable as exc:
        print(f"flexmarl {args.command}: cannot reach the cluster: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except InvalidArgument as exc:
        print(f"flexmarl {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FlexmarlError as exc:
        print(f"flexmarl {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"flexmarl {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def entry_point() -> None:
    """Console-script entry."""
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())


if __name__ == "__main__":
    # `python -m flexmarl.cli`: a subcommand in another module (flexmarl.slurm) imports this one as
    # flexmarl.cli; let that be this very module, not a second copy with a CliError of its own.
    sys.modules.setdefault("flexmarl.cli", sys.modules[__name__])
    entry_point()
