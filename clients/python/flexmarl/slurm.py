"""`flexmarl slurm`: a FlexMARL cluster over a Slurm allocation, one job through it, then teardown.

Run inside an allocation (``sbatch deploy/slurm/flexmarl.sbatch JOB.yaml`` or from ``salloc``):

1. reads the allocation (``SLURM_JOB_ID``, its nodes from ``scontrol show hostnames``, each node's
   address from ``scontrol show node``, its GPUs from ``SLURM_GPUS_ON_NODE``) and refuses, in one
   line, a layout the allocation cannot hold (too few nodes, too few GPUs per node);
2. lays the roles over the nodes (:func:`layout`): etcd, orchestratord and stored on the control
   node (the first, or ``--control-node``), traind on the first ``--trainer-nodes`` nodes and
   rolloutd on the next ``--rollout-nodes`` (on one node, everything shares it);
3. starts every process as an ``srun --overlap`` job step on its node, kept in the foreground
   (:class:`SrunSteps`; Slurm's ``proctrack/linuxproc`` loses a process that detaches itself), through
   the same :class:`flexmarl.localcluster.LocalCluster` as ``flexmarl up``; waits until every daemon
   is registered; writes ``<run_dir>/cluster.json`` (so ``flexmarl status --run-dir`` works);
4. submits the job and prints a line per step; a daemon step that dies is started again (as
   systemd's ``Restart=`` does) and the job goes on;
5. on the job's end, SIGTERM (``scancel``) or a failure, stops every step and exits (0 when the job
   succeeded). Slurm kills whatever outlives ``KillWait``.

The run dir (default ``runs/slurm-<job id>``) must be on a file system every node shares, as
must the Python environment, the job's models and (``publish_location: file``) the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from flexmarl.placement import Host, HostRunner, Placement

if TYPE_CHECKING:
    from flexmarl.localcluster import DaemonSupervisor

#: etcd's client port on the control node unless --etcd-port says otherwise (etcd's own default).
DEFAULT_ETCD_PORT = 2379


class SlurmError(Exception):
    """The allocation cannot run the requested layout, or this is no allocation (one line for the user)."""


class SrunSteps(HostRunner):
    """Each process is one ``srun --overlap`` step of one task on its node, in the foreground.

    ``--overlap`` lets the steps share the allocation's CPUs (and the batch step's); a worker's GPUs
    come from ``--gres=gpu:N`` (Slurm sets its ``CUDA_VISIBLE_DEVICES``, which the daemons use);
    ``--kill-on-bad-exit=0`` keeps one step's failure from ending the others (the launcher restarts it).
    """

    def __init__(self, srun: str = "srun") -> None:
        self.srun = srun

    def wrap(self, host: Host, argv: Sequence[str], *, name: str, gpus: int = 0) -> list[str]:
        """See :meth:`HostRunner.wrap`."""
        gres = [f"--gres=gpu:{gpus}"] if gpus else []
        return [self.srun, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host.name}",
                f"--job-name=flexmarl-{name}", "--kill-on-bad-exit=0", "--quiet", "--export=ALL", *gres, *argv]


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The part of a Slurm allocation a layout needs."""

    job_id: str
    nodes: tuple[Host, ...]
    gpus_per_node: int


def _run(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"`{' '.join(argv)}` failed: {exc}") from None
    if done.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _node_address(record: str, name: str) -> str:
    """The IP address of a node from its ``scontrol show node -o`` line (NodeAddr, resolved)."""
    match = re.search(r"\bNodeAddr=(\S+)", record)
    addr = match.group(1) if match else name
    try:
        return socket.gethostbyname(addr)
    except OSError:
        raise SlurmError(f"node {name}: its address {addr!r} does not resolve") from None


def read_allocation(env: Mapping[str, str] | None = None) -> Allocation:
    """The allocation this process runs in; raises SlurmError outside one."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "")
    nodelist = env.get("SLURM_JOB_NODELIST", "") or env.get("SLURM_NODELIST", "")
    if not job_id or not nodelist:
        raise SlurmError("not inside a Slurm allocation (no SLURM_JOB_ID / SLURM_JOB_NODELIST): run it from an "
                         "sbatch script (deploy/slurm/flexmarl.sbatch) or an salloc shell")
    if shutil.which("scontrol") is None or shutil.which("srun") is None:
        raise SlurmError("scontrol/srun not found on PATH (Slurm's client commands are needed)")
    names = _run(["scontrol", "show", "hostnames", nodelist]).split()
    records = {}
    for line in _run(["scontrol", "show", "node", "-o", ",".join(names)]).splitlines():
        match = re.match(r"NodeName=(\S+)", line)
        if match:
            records[match.group(1)] = line
    nodes = tuple(Host(name, _node_address(records.get(name, ""), name)) for name in names)
    gpus = env.get("SLURM_GPUS_ON_NODE", "0").strip() or "0"
    return Allocation(job_id, nodes, int(gpus) if gpus.isdigit() else 0)


@dataclasses.dataclass(frozen=True)
class LayoutRequest:
    """What the user asked for: node counts per worker role, a control node, GPUs per worker node."""

    trainer_nodes: int = 0
    rollout_nodes: int = 0
    control_node: str = ""
    gpus_per_node: int = 0


def layout(allocation: Allocation, request: LayoutRequest, runner: HostRunner) -> Placement:
    """The roles over the allocation's nodes; raises SlurmError naming what is missing.

    On one node every role shares it. On more, traind takes the first ``trainer_nodes`` (default:
    half, rounded down, at least one) and rolloutd the next ``rollout_nodes`` (default: the rest);
    the control daemons run on the first node (or ``control_node``) beside the workers.
    """
    nodes = allocation.nodes
    count = len(nodes)
    named = [n for n in nodes if n.name == request.control_node]
    control = named[0] if named else nodes[0]
    if request.control_node:
        if not named:
            raise SlurmError(f"--control-node {request.control_node}: not a node of the allocation "
                             f"({', '.join(n.name for n in nodes)})")
    if request.gpus_per_node > allocation.gpus_per_node:
        raise SlurmError(f"--gpus-per-node {request.gpus_per_node}: the allocation has {allocation.gpus_per_node} "
                         "GPUs per node (SLURM_GPUS_ON_NODE; ask sbatch for --gres=gpu:N)")
    if count == 1 and not (request.trainer_nodes > 1 or request.rollout_nodes > 1):
        if request.gpus_per_node:
            raise SlurmError(f"--gpus-per-node {request.gpus_per_node}: rolloutd and traind would share the one node's "
                             "GPUs; allocate at least 2 nodes (sbatch --nodes 2)")
        return Placement(control=control, rollout=nodes, trainer=nodes, runner=runner)
    trainers = request.trainer_nodes or max(1, count // 2)
    rollouts = request.rollout_nodes or max(1, count - trainers)
    if trainers < 1 or rollouts < 1 or trainers + rollouts > count:
        raise SlurmError(f"the allocation has {count} node{'s' if count != 1 else ''}; {trainers} trainer + "
                         f"{rollouts} rollout nodes need {max(trainers, 1) + max(rollouts, 1)} (sbatch --nodes)")
    return Placement(control=control, trainer=nodes[:trainers], rollout=nodes[trainers:trainers + rollouts],
                     runner=runner, gpus_per_worker=request.gpus_per_node)


def describe(placement: Placement) -> str:
    """One line per role: which nodes run what."""
    def names(hosts: Sequence[Host]) -> str:
        return ", ".join(f"{h.name} ({h.address})" for h in hosts)

    return "\n".join([f"  control (etcd, orchestratord, stored): {names([placement.control])}",
                      f"  traind:   {names(placement.trainer)}",
                      f"  rolloutd: {names(placement.rollout)}"])


class _Cancelled(Exception):
    """SIGTERM (scancel, the end of the allocation's time) or SIGINT reached the launcher."""


def _raise_cancelled(signum: int, frame: FrameType | None) -> None:
    raise _Cancelled(signal.Signals(signum).name)


def add_parser(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
               common: argparse.ArgumentParser) -> None:
    """Registers `flexmarl slurm` on the CLI's subcommands."""
    p = sub.add_parser("slurm", parents=[common],
                       help="inside a Slurm allocation: lay a cluster over its nodes, run one job, tear it all down")
    p.add_argument("job_file", help="the job to run (YAML/JSON)")
    p.add_argument("--trainer-nodes", type=int, default=0,
                   help="nodes running traind (default: half of the allocation; all of a 1-node one)")
    p.add_argument("--rollout-nodes", type=int, default=0,
                   help="nodes running rolloutd (default: the nodes traind does not take)")
    p.add_argument("--control-node", default="", help="node for etcd, orchestratord and stored (default: the first)")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs each worker step takes (srun --gres=gpu:N); the allocation must have them")
    p.add_argument("--engine-replicas", type=int, default=2, help="engine replicas of each rolloutd")
    p.add_argument("--trainer-slots", type=int, default=1, help="training slots of each traind")
    p.add_argument("--etcd-port", type=int, default=DEFAULT_ETCD_PORT, help="etcd's client port on the control node")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of a dead daemon step within 5 minutes before the launch gives up")
    p.add_argument("--no-preflight", action="store_true", help="skip loading the environment before submitting")
    # Not set_defaults(run_dir=...): the --run-dir action is shared with every subcommand (parents=[common]),
    # so a default set here would become theirs too (it made `flexmarl up` and `demo` run in the cwd).
    p.set_defaults(func=cmd_slurm)


def cmd_slurm(args: argparse.Namespace) -> int:
    """Lays a cluster over the allocation, runs the job, tears everything down; exit 0 when it succeeded."""
    from flexmarl import cli
    from flexmarl.cluster import LaunchError
    from flexmarl.localcluster import DaemonSupervisor, GaveUp, LocalCluster, LocalClusterConfig, RestartPolicy

    try:
        allocation = read_allocation()
        placement = layout(allocation, LayoutRequest(args.trainer_nodes, args.rollout_nodes, args.control_node,
                                                     args.gpus_per_node), SrunSteps())
    except SlurmError as exc:
        raise cli.CliError(str(exc), cli.EXIT_USAGE) from None
    given = args.run_dir and args.run_dir != str(cli.DEFAULT_RUN_DIR)
    run_dir = Path(args.run_dir if given else Path("runs") / f"slurm-{allocation.job_id}").resolve()
    args.run_dir = str(run_dir)
    models_dir = run_dir / "models"
    raw, spec = cli._read_spec_file(args.job_file, models_dir)  # a bad job file starts nothing
    if not args.no_preflight:
        cli._preflight(args.job_file, spec)
    print(f"flexmarl slurm: allocation {allocation.job_id}, {len(allocation.nodes)} node(s), run dir {run_dir}\n"
          f"{describe(placement)}", flush=True)
    cluster = LocalCluster(LocalClusterConfig(
        run_dir=run_dir, trainer_workers=len(placement.trainer), rollout_workers=len(placement.rollout),
        engine_replicas=args.engine_replicas, trainer_slots=args.trainer_slots, persistent=True,
        placement=placement, etcd_port=args.etcd_port))
    previous = {sig: signal.signal(sig, _raise_cancelled) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop_supervising = threading.Event()
    failure: list[str] = []
    try:
        try:
            cluster.start()
        except LaunchError as exc:
            raise cli._did_not_start(exc, run_dir) from None
        print(f"cluster up: etcd {cluster.etcd_endpoint}; "
              + ", ".join(f"{name} {proc.address}" for name, proc in cluster.daemons.items()), flush=True)
        supervisor = DaemonSupervisor(cluster.daemons, RestartPolicy(max_restarts=args.max_restarts),
                                      on_restart=lambda name: cluster.write_cluster_file())
        thread = threading.Thread(target=_supervise, args=(supervisor, stop_supervising, failure),
                                  name="daemon supervisor", daemon=True)
        thread.start()
        args.etcd, args.address = cluster.etcd_endpoint, ""
        with cli._client(args) as client:
            job_id = client.submit(cli._materialize_spec(args.job_file, raw, models_dir, False), preflight=False)
            print(f"submitted job {job_id}", flush=True)
            final = cli.watch_job(client, job_id)
        if failure:
            raise cli.CliError(failure[0])
        return cli._outcome(job_id, final)
    except _Cancelled as exc:
        if failure:  # the supervisor gave up on a daemon and stopped the launch
            raise cli.CliError(failure[0]) from None
        print(f"flexmarl slurm: {exc} received; stopping every step", flush=True)
        return cli.EXIT_INTERRUPTED
    except GaveUp as exc:
        raise cli.CliError(str(exc)) from None
    finally:
        stop_supervising.set()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second scancel must not cut the teardown short
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(supervisor: DaemonSupervisor, stop: threading.Event, failure: list[str]) -> None:
    """Restarts dead daemon steps until stopped; on giving up, records why and stops the launch (SIGTERM)."""
    from flexmarl.localcluster import GaveUp

    while not stop.wait(0.5):
        try:
            for line in supervisor.check():
                print(line, flush=True)
        except GaveUp as exc:
            failure.append(str(exc))
            os.kill(os.getpid(), signal.SIGTERM)
            return


