"""Where a cluster's processes run: hosts with addresses, and how a command is started on one.

One code path lays out every cluster FlexMARL starts itself (:class:`flexmarl.localcluster.LocalCluster`):
a :class:`Placement` names the control host (etcd, orchestratord, stored) and the hosts of the
rollout and trainer workers, and its :class:`HostRunner` turns a command into one that runs on a
host. On one machine the runner is the identity and every host is ``127.0.0.1``; inside a Slurm
allocation (:mod:`flexmarl.slurm`) each process is an ``srun --overlap`` job step on its node; the
multi-host test runs each in a network namespace (``ip netns exec``). Every daemon binds and
advertises its host's address from this configuration, never an assumed loopback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Host:
    """A machine (or a stand-in for one): its name for the runner and the address others reach it at."""

    name: str
    address: str

    @property
    def loopback(self) -> bool:
        """Whether the address is this machine's loopback (nothing else can reach it)."""
        return self.address.startswith("127.") or self.address in ("::1", "localhost")


LOCALHOST = Host("localhost", LOOPBACK)


class HostRunner:
    """Starts a command on a host. This base runs it here, as it is (every host is this machine)."""

    def wrap(self, host: Host, argv: Sequence[str], *, name: str, gpus: int = 0) -> list[str]:
        """The command line that runs ``argv`` on ``host`` as the process ``name`` with ``gpus`` devices."""
        return list(argv)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The hosts of a cluster's roles; workers of a role go round-robin over the role's hosts.

    The control host runs etcd and orchestratord (and stored unless ``store`` names another host).
    """

    control: Host = LOCALHOST
    #: stored's host (None: the control host's).
    store: Host | None = None
    rollout: tuple[Host, ...] = (LOCALHOST,)
    trainer: tuple[Host, ...] = (LOCALHOST,)
    runner: HostRunner = dataclasses.field(default_factory=HostRunner)
    #: Devices each worker process is given by the runner (0: the runner assigns none).
    gpus_per_worker: int = 0

    def __post_init__(self) -> None:
        if not self.rollout or not self.trainer:
            raise ValueError("placement: every role needs at least one host")

    @property
    def store_host(self) -> Host:
        """The host of stored (the control host unless ``store`` is set)."""
        return self.store or self.control

    def rollout_host(self, index: int) -> Host:
        """The host of rollout worker ``index``."""
        return self.rollout[index % len(self.rollout)]

    def trainer_host(self, index: int) -> Host:
        """The host of trainer worker ``index``."""
        return self.trainer[index % len(self.trainer)]


LOCAL_PLACEMENT = Placement()
