"""What the balancer decides on, measured: each replica's delivered tokens/s and the cost of a weight load.

The hierarchical balancer (:mod:`rolloutd.balancer`) estimates a model group's drain time as its
outstanding tokens over its replicas' tokens/s, and moves a replica only if the move beats a weight
load. Fixed constants for both are wrong on any engine whose speed differs from them (a modelled
device, another GPU, another model size), and a wrong rate or cost keeps every replica where it
started. :class:`ReplicaRates` measures each replica; :class:`ReloadCost` measures the loads. The
configured values are the priors, used until something is measured.

**A replica's rate** is the tokens it delivers per second it is busy generating. A replica serving
N requests at once delivers their sum over the time it is busy, not each request's tokens over
its own latency, so each generation is charged its *share* of the busy time: while c generations
run, each is charged 1/c of every second (``∫ dt / c(t)`` over its life, kept as one running
integral, so O(1) per event). The shares of all generations add up to the busy time exactly, and a
finished generation brings its tokens and its share together: a measurement never waits for the
generations still running (a replica that is always busy, its requests long, is measured from its
first answer). Measurements are folded into an exponentially weighted average per ``window_s``
of busy time (charged shares), each window weighing ``1 - 2^(-busy / half_life_s)``: the estimate
follows a replica whose speed changes (another model, another load) within a few half-lives of
busy time, and idle time changes nothing. Until the first window is measured the prior is the rate.

A delivered rate depends on the load the replica gets as well as on the engine: a decode step of
one sequence costs nearly what a step of many does, so a lightly loaded replica delivers far less
than it could (on the benchmark's modelled device, a thirtieth), and a group counted at its
replicas' delivered rates would look slow exactly when it is light. The replicas one rolloutd
serves run one architecture (a weight load keeps it), so they are alike: the router counts every
replica at their *capacity*, the best rate measured among them, a peak that decays
(:meth:`ReplicaRates.capacity`), and measures a replica afresh when it serves another model
(:meth:`ReplicaRate.restart`).

**The reload cost** is an exponentially weighted average of the measured seconds of each weight
load from disk (the configured ``reassignment_cost_s`` until the first one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from flexmarl.errors import InvalidArgument

if TYPE_CHECKING:
    from rolloutd.balancer import HierarchicalBalancer

#: A capacity change the balancer is told of (smaller ones are not worth re-counting every replica for).
CAPACITY_CHANGE = 0.02


@dataclasses.dataclass(frozen=True)
class RateSettings:
    """How replica rates are measured.

    Attributes:
        window_s: Busy seconds (charged shares) folded into one measurement; the prior holds until
            the first.
        half_life_s: Busy seconds after which a measurement weighs half of the estimate.
        reload_weight: Weight of each new reload measurement in the reload cost's average.
        capacity_half_life_s: Wall seconds after which the replicas' measured peak (their capacity,
            :meth:`ReplicaRates.capacity`) has halved unless measured again.
    """

    window_s: float = 1.0
    half_life_s: float = 10.0
    reload_weight: float = 0.3
    capacity_half_life_s: float = 120.0

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and self.half_life_s > 0 and 0 < self.reload_weight <= 1
                and self.capacity_half_life_s > 0):
            raise InvalidArgument("window_s, half_life_s and capacity_half_life_s must be > 0, reload_weight in (0, 1]")


@dataclasses.dataclass(frozen=True)
class GenerationMark:
    """Where one generation started on its replica's busy-share integral (see :meth:`ReplicaRate.begin`)."""

    model_key: str
    share_start_s: float


class ReplicaRate:
    """Delivered tokens per busy second of one replica (see the module doc); pure, the caller passes the clock."""

    def __init__(self, prior_tokens_per_s: float, model_key: str = "", settings: RateSettings | None = None) -> None:
        if prior_tokens_per_s <= 0:
            raise InvalidArgument(f"prior_tokens_per_s must be > 0, got {prior_tokens_per_s}")
        self._settings = settings or RateSettings()
        self.prior_tokens_per_s = prior_tokens_per_s
        #: The model the measurement is of (a generation of another model measures nothing here).
        self.model_key = model_key
        self._measured: float | None = None
        self._active = 0
        self._share_s = 0.0  # ∫ dt / c(t) over the busy time so far
        self._last_s = 0.0
        self._window_tokens = 0
        self._window_share_s = 0.0
        #: Busy seconds measured (charged to finished generations) since the last restart.
        self.measured_busy_s = 0.0

    @property
    def tokens_per_s(self) -> float:
        """The measured rate, or the prior until a window is measured."""
        return self.prior_tokens_per_s if self._measured is None else self._measured

    @property
    def measured(self) -> bool:
        """Whether a window was measured since the last restart."""
        return self._measured is not None

    def begin(self, now_s: float) -> GenerationMark:
        """A generation starts on the replica now."""
        self._advance(now_s)
        self._active += 1
        return GenerationMark(self.model_key, self._share_s)

    def end(self, mark: GenerationMark, now_s: float, tokens: int | None) -> bool:
        """The generation ``mark`` ended now with ``tokens`` delivered (None: it failed: nothing is charged).

        Returns:
            Whether :attr:`tokens_per_s` changed (a window was folded in).
        """
        if tokens is not None and tokens < 0:
            raise InvalidArgument(f"tokens must be >= 0, got {tokens}")
        self._advance(now_s)
        self._active = max(0, self._active - 1)
        if tokens is None or mark.model_key != self.model_key:
            return False
        share_s = max(0.0, self._share_s - mark.share_start_s)
        self._window_tokens += tokens
        self._window_share_s += share_s
        self.measured_busy_s += share_s
        if self._window_share_s < self._settings.window_s:
            return False
        sample = self._window_tokens / self._window_share_s
        if self._measured is None:
            self._measured = sample
        else:
            weight = 1.0 - math.pow(2.0, -self._window_share_s / self._settings.half_life_s)
            self._measured += weight * (sample - self._measured)
        self._window_tokens, self._window_share_s = 0, 0.0
        return True

    def restart(self, model_key: str, prior_tokens_per_s: float) -> None:
        """The replica serves ``model_key`` now: measured afresh from ``prior_tokens_per_s``.

        Generations still running (of the old model) end without being charged.
        """
        if prior_tokens_per_s <= 0:
            raise InvalidArgument(f"prior_tokens_per_s must be > 0, got {prior_tokens_per_s}")
        self.model_key = model_key
        self.prior_tokens_per_s = prior_tokens_per_s
        self._measured = None
        self._window_tokens, self._window_share_s = 0, 0.0
        self.measured_busy_s = 0.0

    def _advance(self, now_s: float) -> None:
        if self._active > 0 and now_s > self._last_s:
            self._share_s += (now_s - self._last_s) / self._active
        self._last_s = max(self._last_s, now_s)


class ReplicaRates:
    """A :class:`ReplicaRate` per replica id, each from the configured prior."""

    def __init__(self, prior_tokens_per_s: float, settings: RateSettings | None = None) -> None:
        if prior_tokens_per_s <= 0:
            raise InvalidArgument(f"prior_tokens_per_s must be > 0, got {prior_tokens_per_s}")
        self.prior_tokens_per_s = prior_tokens_per_s
        self._settings = settings or RateSettings()
        self._rates: dict[str, ReplicaRate] = {}
        self._peak: float | None = None
        self._peak_s = 0.0

    def of(self, replica_id: str) -> ReplicaRate:
        """The replica's estimator (made on first use, from the prior)."""
        rate = self._rates.get(replica_id)
        if rate is None:
            rate = self._rates[replica_id] = ReplicaRate(self.prior_tokens_per_s, settings=self._settings)
        return rate

    def tokens_per_s(self, replica_id: str) -> float:
        """The replica's rate (the prior before anything is measured)."""
        return self.of(replica_id).tokens_per_s

    def capacity(self, now_s: float) -> float:
        """Tokens/s one replica can deliver: the best measured rate, a peak that halves per ``capacity_half_life_s``.

        The replicas one rolloutd serves run one architecture (a weight load keeps it), so they are
        alike; the ones delivering less were given less to do (a decode step of one sequence costs
        nearly what a step of many does). The prior until a replica is measured.
        """
        measured = [rate.tokens_per_s for rate in self._rates.values() if rate.measured]
        if not measured:
            return self.prior_tokens_per_s
        if self._peak is None:
            self._peak = max(measured)
        else:
            decay = math.pow(2.0, -max(0.0, now_s - self._peak_s) / self._settings.capacity_half_life_s)
            self._peak = max(max(measured), self._peak * decay)
        self._peak_s = now_s
        return self._peak


class ReloadCost:
    """Seconds of one weight load: an exponentially weighted average of measured loads, the prior before one."""

    def __init__(self, prior_s: float, settings: RateSettings | None = None) -> None:
        if prior_s < 0:
            raise InvalidArgument(f"prior_s must be >= 0, got {prior_s}")
        self.prior_s = prior_s
        self._weight = (settings or RateSettings()).reload_weight
        self._measured: float | None = None
        #: Loads measured so far.
        self.loads = 0

    @property
    def seconds(self) -> float:
        """The estimate (the prior until a load is measured)."""
        return self.prior_s if self._measured is None else self._measured

    @property
    def measured(self) -> bool:
        """Whether a load was measured."""
        return self._measured is not None

    def observe(self, seconds: float) -> None:
        """Records one measured load."""
        if seconds < 0 or not math.isfinite(seconds):
            raise InvalidArgument(f"a load's seconds must be finite and >= 0, got {seconds}")
        self._measured = seconds if self._measured is None else self._measured + self._weight * (
            seconds - self._measured)
        self.loads += 1


class BalancerFeed:
    """What a router measures for its balancer, fed to it as it changes (``BalancerConfig.measured_rates``).

    :class:`rolloutd.router.RolloutRouter` drives it with its generations and weight loads, and
    ``benchmarks.sim``'s rolloutd processes with their modelled ones: every replica is counted at the
    replicas' capacity (:meth:`ReplicaRates.capacity`), re-fed when it moved by more than
    :data:`CAPACITY_CHANGE`, and a move costs the measured load (:class:`ReloadCost`).
    """

    def __init__(self, prior_tokens_per_s: float, prior_reload_s: float, settings: RateSettings | None = None) -> None:
        self.rates = ReplicaRates(prior_tokens_per_s, settings)
        self.reload_cost = ReloadCost(prior_reload_s, settings)
        #: What the balancer counts each replica at (the prior until a capacity is fed).
        self.capacity = prior_tokens_per_s

    def begin(self, replica_id: str, model_key: str, now_s: float) -> GenerationMark:
        """A generation starts on a replica serving ``model_key`` (another model than before: measured afresh)."""
        rate = self.rates.of(replica_id)
        if rate.model_key != model_key:
            rate.restart(model_key, self.rates.prior_tokens_per_s)
        return rate.begin(now_s)

    def end(self, replica_id: str, mark: GenerationMark, now_s: float, tokens: int | None,
            balancer: HierarchicalBalancer | None) -> None:
        """The generation ``mark`` ended with ``tokens`` (None: it failed); a changed capacity reaches ``balancer``."""
        if not self.rates.of(replica_id).end(mark, now_s, tokens):
            return
        capacity = self.rates.capacity(now_s)
        if balancer is not None and abs(capacity - self.capacity) > CAPACITY_CHANGE * self.capacity:
            self.capacity = capacity
            balancer.set_every_replica_rate(capacity)

    def reloaded(self, seconds: float, balancer: HierarchicalBalancer | None) -> None:
        """A weight load took ``seconds``: ``balancer``'s move cost follows the measured average."""
        self.reload_cost.observe(seconds)
        if balancer is not None:
            balancer.set_reassignment_cost_s(self.reload_cost.seconds)
