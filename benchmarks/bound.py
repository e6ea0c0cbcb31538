"""What a step cannot beat, and what the control plane costs: the device-work bound and the RPC overhead.

The **device-work bound** of a step (:func:`device_work_bound`) is the larger of

* rollout: the replica-seconds the step's generated tokens need on the device model
  (:mod:`flexmarl.devicemodel`) at the best batching the engine allows, over the rollout replicas;
* training: the slot-seconds of forward + backward over the step's trained tokens and one
  optimizer step per agent (``traind/pacing.py`` charges exactly these), over the trainer slots.

It is a lower bound, derived from the tokens a run actually generated (its step records: episodes
and response tokens per agent and step), never from constants:

* prefill: ``prefill_s`` of every episode's prompt, once (a retracted sequence's re-prefill is
  overhead, not work);
* decode: an iteration costs ``max(memory, compute)`` (``decode_iteration_s``); summed over a
  step that is at least ``max(sum of memory terms, sum of compute terms)``. The memory terms are
  the weights read once per iteration plus the KV cache read per context token: ``(n_iter W +
  kv sum(C)) / (hbm eff)``. ``sum(C)``, the context tokens summed over every decoded token, is
  ``sum_i (P L_i + L_i^2 / 2)`` and at least ``P R + R^2 / (2 E)`` for ``E`` sequences of ``R``
  tokens in all (equal lengths minimise it). ``n_iter`` per replica is at least its tokens over
  ``max_running_requests`` and at least its reserved KV token-iterations over the KV capacity:
  the embedded engine (and SGLang) holds ``prompt + max_new_tokens`` per running sequence, and a
  sequence of ``L_i`` tokens runs ``L_i`` iterations, so ``sum_i (P + L_i) L_i / capacity >=
  (P R + R^2 / E) / capacity``. The compute term is ``2 params`` FLOPs per token;
* one weight reload (``weight_transfer_s``) per agent and step: every new version is loaded at
  least once;
* training: ``train_tokens_s`` of ``E P + R`` tokens and one ``optimizer_step_s`` per agent and
  step (state swaps between agents are left out: a binding that keeps agents resident needs none).

The **orchestration overhead** (:func:`rpc_overhead`) is read from the daemons' Prometheus
histograms ``flexmarl_<daemon>_rpc_seconds`` (server-side handler time, by method): the lease,
report, ack, commit and slot-event RPCs of orchestratord and every stored RPC (experiences and
blobs). Two of them are long polls (``LeaseRolloutTasks``, ``PollTrainerWork`` wait up to 2 s
for work) whose handler time is mostly waiting: of those only the observations that ended within
:data:`LONG_POLL_SERVED_S` count, each at its bucket's upper edge (an upper bound of its cost);
the others waited for work that did not exist yet and are left out. Handler seconds of concurrent
RPCs add up, so the share overstates what the step's critical path pays.
"""

from __future__ import annotations

import dataclasses
import math
import urllib.request
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from flexmarl import devicemodel

#: orchestratord's RPCs on the rollout/training data path (status, watch and submit RPCs are the user's).
ORCHESTRATOR_RPCS = frozenset(
    {
        "LeaseRolloutTasks",
        "RenewLeases",
        "ReportRolloutTask",
        "PollTrainerWork",
        "AckMicroBatch",
        "CommitStep",
        "ReportSlotEvent",
    }
)
LONG_POLL_RPCS = frozenset({"LeaseRolloutTasks", "PollTrainerWork"})
#: A long poll that ended within this was served (work was there), not parked.
LONG_POLL_SERVED_S = 0.1


@dataclasses.dataclass(frozen=True)
class AgentStepWork:
    """What one agent's step generated and trained: its episodes and response tokens (modelled)."""

    agent: str
    episodes: int
    response_tokens: float


@dataclasses.dataclass(frozen=True)
class DeviceWorkBound:
    """Device seconds of one step's work and the bound they set (modelled seconds)."""

    rollout_replica_s: float  # replica-seconds of prefill, decode and reloads
    train_slot_s: float  # slot-seconds of forward + backward and optimizer steps
    replicas: int
    slots: int
    # The busiest agent's own slot-seconds: one agent's step runs on one slot (max_slots 1), so no schedule
    # finishes a step before that agent's training of it, however many slots there are.
    busiest_agent_train_s: float = 0.0

    @property
    def rollout_s(self) -> float:
        """Rollout device-seconds over the rollout replicas."""
        return self.rollout_replica_s / self.replicas

    @property
    def train_s(self) -> float:
        """Training device-seconds over the trainer slots."""
        return self.train_slot_s / self.slots

    @property
    def step_s(self) -> float:
        """The bound: the larger of the two."""
        return max(self.rollout_s, self.train_s)

    @property
    def agent_step_s(self) -> float:
        """The bound with one slot per agent: also at least the busiest agent's own training."""
        return max(self.step_s, self.busiest_agent_train_s)

    @property
    def bound_by(self) -> str:
        """Which side sets the bound."""
        return "rollout" if self.rollout_s >= self.train_s else "train"


def device_work_bound(
    profile: devicemodel.DeviceProfile,
    work: Sequence[AgentStepWork],
    *,
    prompt_tokens: float,
    replicas: int,
    slots: int,
) -> DeviceWorkBound:
    """The device-work bound of one step that did ``work`` (one entry per agent; modelled tokens).

    ``profile`` is the run's (its ``rollout_devices_per_replica`` and ``train_devices_per_slot``
    apply); ``prompt_tokens`` is the modelled prompt of every turn. See the module docstring.
    """
    if replicas <= 0 or slots <= 0:
        raise ValueError("replicas and slots must be positive")
    bandwidth = profile.hbm_bytes_per_s * profile.hbm_efficiency * profile.rollout_devices_per_replica
    flops = profile.peak_flops * profile.prefill_mfu * profile.rollout_devices_per_replica
    capacity = devicemodel.kv_capacity_tokens(profile)
    prefill = memory = compute = reload = train = busiest = 0.0
    for agent in work:
        episodes, tokens = agent.episodes, agent.response_tokens
        if episodes <= 0:
            continue
        prefill += devicemodel.prefill_s(profile, prompt_tokens * episodes)
        context = prompt_tokens * tokens + tokens * tokens / (2.0 * episodes)
        reserved = prompt_tokens * tokens + tokens * tokens / episodes
        # Every replica reads the weights once per iteration; n_iter summed over replicas is at least this.
        iterations = max(tokens / profile.max_running_requests, reserved / capacity if capacity > 0 else math.inf)
        memory += (iterations * profile.weight_bytes + profile.kv_bytes_per_token * context) / bandwidth
        compute += 2.0 * profile.model_params * tokens / flops
        reload += devicemodel.weight_transfer_s(profile)
        own = devicemodel.train_tokens_s(profile, prompt_tokens * episodes + tokens) + devicemodel.optimizer_step_s(
            profile)
        train += own
        busiest = max(busiest, own)
    return DeviceWorkBound(prefill + max(memory, compute) + reload, train, replicas, slots, busiest)


def mean_bound(bounds: Sequence[DeviceWorkBound]) -> DeviceWorkBound:
    """The per-step mean of several steps' bounds (same replicas and slots)."""
    if not bounds:
        raise ValueError("no steps")
    count = len(bounds)
    return DeviceWorkBound(
        sum(b.rollout_replica_s for b in bounds) / count,
        sum(b.train_slot_s for b in bounds) / count,
        bounds[0].replicas,
        bounds[0].slots,
        sum(b.busiest_agent_train_s for b in bounds) / count,
    )


# ---- orchestration overhead -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RpcTime:
    """Handler seconds and calls of one daemon's method, as counted for the overhead."""

    daemon: str
    method: str
    seconds: float
    calls: int
    left_out_calls: int = 0  # long polls that waited for work


def scrape(port: int, host: str = "127.0.0.1", timeout_s: float = 5.0) -> str:
    """The Prometheus text of a daemon's metrics endpoint."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as response:  # noqa: S310
        return str(response.read().decode("utf-8"))


def _histograms(text: str, name: str) -> dict[str, tuple[float, float, list[tuple[float, float]]]]:
    """method -> (sum, count, cumulative buckets (le, count)) of the histogram ``name``."""
    out: dict[str, tuple[float, float, list[tuple[float, float]]]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            method = sample.labels.get("method", "")
            total, count, buckets = out.get(method, (0.0, 0.0, []))
            if sample.name.endswith("_sum"):
                total = float(sample.value)
            elif sample.name.endswith("_count"):
                count = float(sample.value)
            elif sample.name.endswith("_bucket"):
                buckets = [*buckets, (float(sample.labels["le"]), float(sample.value))]
            out[method] = (total, count, buckets)
    return out


def rpc_times(daemon: str, kind: str, text: str) -> list[RpcTime]:
    """The overhead-counted RPC time of one daemon of ``kind`` (orchestratord, stored) from its metrics text."""
    if kind not in ("orchestratord", "stored"):
        return []
    times = []
    for method, (total, count, buckets) in sorted(_histograms(text, f"flexmarl_{kind}_rpc_seconds").items()):
        if kind == "orchestratord" and method not in ORCHESTRATOR_RPCS:
            continue
        if method in LONG_POLL_RPCS:
            seconds, served, below = 0.0, 0.0, 0.0
            for le, cumulative in sorted(buckets):
                if le > LONG_POLL_SERVED_S:
                    break
                seconds += (cumulative - below) * le
                served, below = cumulative, cumulative
            times.append(RpcTime(daemon, method, seconds, int(served), int(count - served)))
        else:
            times.append(RpcTime(daemon, method, total, int(count)))
    return times


def rpc_overhead(before: Iterable[RpcTime], after: Iterable[RpcTime]) -> list[RpcTime]:
    """Per daemon and method, what ``after`` counted beyond ``before`` (two scrapes of one run)."""
    earlier: Mapping[tuple[str, str], RpcTime] = {(t.daemon, t.method): t for t in before}
    out = []
    for t in after:
        b = earlier.get((t.daemon, t.method), RpcTime(t.daemon, t.method, 0.0, 0))
        out.append(
            RpcTime(t.daemon, t.method, t.seconds - b.seconds, t.calls - b.calls, t.left_out_calls - b.left_out_calls)
        )
    return out
