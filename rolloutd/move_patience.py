"""When the hierarchical balancer makes a move it planned, and what a move's drain costs.

A replica move pays before it gains: the donor drains (takes no new request until the ones it runs
have ended) and loads the new weights; only then does it serve the group it was moved to. If the
demand that made the move worth it has gone by then (the heavy role moved on, the hint was an
average of work already done), the move lost its cost, and the move back loses it again. On the
``shifting`` benchmark shape (docs/benchmarks.md), where each agent is heavy in turn for a few steps
and what rolloutd holds in flight spans several turns, the balancer moved replicas back and forth 8
times in a minute, drains of up to 60 s each, and ran 0.90x fixed shares.

Two rules, both on what was measured:

* :class:`DrainTimes`: a move's drain is counted at least as long as the drains measured from the
  donor's group (from the move to the replica's load; an exponentially weighted average), not only
  its outstanding tokens over its rate: a draining replica's batch shrinks, and its last request
  takes its whole latency however few tokens are left. (A prior from the group's generation latency,
  for the drains before the first is measured, was tried and taken out: on ``saturating`` it counted
  10-32 s for donors whose old requests drained in 0-2 s, on ``shifting`` it did not stop the first,
  50-s drain, and no step reading moved; docs/benchmarks.md, "The drain prior".)
* :class:`MovePatience`, ski rental (Karlin, Manasse, Rudolph, Sleator 1988): a planned move into a
  group is made once the balancer has wanted it, in every rebalance without a break, for
  ``patience`` times the move's estimated cost. Not moving while the imbalance lasts loses at most
  what the move would have cost, so with ``patience`` 1 the balancer loses at most twice what the
  best choice in hindsight does, whether the demand stays or turns; moving at once (``patience`` 0,
  the behaviour before) is unbounded against demand that turns faster than a move completes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from flexmarl.errors import InvalidArgument
from rolloutd.replica_rates import RateSettings, ReloadCost

#: The weight of each new drain measurement in its group's average (the reload cost's).
DRAIN_WEIGHT = RateSettings().reload_weight


class DrainTimes:
    """Measured seconds from a move to its replica's drain ending, per group the replica left.

    Each group's is averaged as a weight load's seconds are (:class:`~rolloutd.replica_rates.ReloadCost`,
    with no prior: 0 until measured).
    """

    def __init__(self, weight: float = DRAIN_WEIGHT) -> None:
        self._settings = RateSettings(reload_weight=weight)  # refuses a weight outside (0, 1]
        self._seconds: dict[str, ReloadCost] = {}
        self._ongoing_s: dict[str, float] = {}

    def observe(self, group: str, seconds: float) -> None:
        """One replica moved away from ``group`` drained in ``seconds`` (finite, >= 0: else InvalidArgument)."""
        average = self._seconds.get(group) or ReloadCost(0.0, self._settings)
        average.observe(seconds)
        self._seconds[group] = average

    def note_ongoing(self, now_s: float, draining: Iterable[tuple[str, float]]) -> None:
        """The drains under way now, (group left, since when): each lasts at least as long as it has so far.

        A drain is measured only when it ends, and on a shape whose generations are long, the first
        ones end long after the balancer made its next moves; one still running already says this much.
        """
        self._ongoing_s = {}
        for group, since_s in draining:
            self._ongoing_s[group] = max(self._ongoing_s.get(group, 0.0), now_s - since_s)

    def estimate_s(self, group: str) -> float:
        """The drain of a replica leaving ``group``: the measured average, or the longest under way if longer."""
        average = self._seconds.get(group)
        return max(average.seconds if average is not None else 0.0, self._ongoing_s.get(group, 0.0))


class MovePatience:
    """Since when each group has been wanted by the balancer's plans, without a break."""

    def __init__(self, patience: float) -> None:
        if not 0 <= patience < float("inf"):
            raise InvalidArgument(f"move patience must be finite and >= 0, got {patience}")
        self._patience = patience
        self._wanted_since_s: dict[str, float] = {}
        self._moved: set[str] = set()  # the groups a move made has touched

    def ripe(self, wanted_cost_s: Mapping[str, float], now_s: float, touched: Collection[str]) -> bool:
        """Whether every move of this plan may be made now.

        Args:
            wanted_cost_s: each group the plan moves replicas into, with the largest estimated cost
                (drain and load, seconds) of a move into it.
            now_s: the balancer's clock.
            touched: the groups the plan moves replicas into or out of. A plan that touches only
                groups no move has touched before is made at once (the first deal after the
                replicas' start, or after a group joined); its groups are remembered as touched.

        A group the plan does not want starts again from zero the next time it is wanted.
        """
        self._wanted_since_s = {key: self._wanted_since_s.get(key, now_s) for key in wanted_cost_s}
        patience = self._patience
        if self._moved.isdisjoint(touched):
            ripe = True
        else:
            ripe = all(now_s - self._wanted_since_s[key] >= patience * cost_s for key, cost_s in wanted_cost_s.items())
        if ripe:
            self._moved.update(touched)
        return ripe

    def forget(self) -> None:
        """No move is wanted now (the plan is empty, or not worth its cost)."""
        self._wanted_since_s.clear()


class EvictionAborts:
    """When a replica that hands its generations on (``BalancerConfig.move_evicts``) aborts again.

    The first abort (``/abort_request`` of all) reaches what the engine runs or queues then. A
    generation the router had sent that the engine had not received yet is missed by it, so the
    abort is repeated; but most of what is still in flight afterwards is generations already
    aborted whose answers have not come back (an engine under a device model answers at the
    modelled end of the iteration). Repeating every poll while anything is in flight made 536
    aborts for 11 moves (docs/benchmarks.md, run J). So: again at once when a generation started
    on the replica since the last abort; otherwise after ``first_s``, then twice as long each time,
    up to ``most_s`` (a missed generation drains at most that much longer).
    """

    def __init__(self, first_s: float, most_s: float) -> None:
        if not 0 < first_s <= most_s < float("inf"):
            raise InvalidArgument(f"abort repeats need 0 < first_s <= most_s < inf, got {first_s}, {most_s}")
        self._first_s, self._most_s = first_s, most_s
        self._entries: int | None = None
        self._wait_s = first_s
        self._next_s = 0.0
        self.count = 0

    def due(self, now_s: float, entries: int) -> bool:
        """Whether to abort now, given how many generations have ever started on the replica (``entries``).

        Call only while generations are in flight on it; a True answer counts as an abort made.
        """
        if entries != self._entries:
            self._wait_s = self._first_s
        elif now_s < self._next_s:
            return False
        else:
            self._wait_s = min(2 * self._wait_s, self._most_s)
        self._entries = entries
        self._next_s = now_s + self._wait_s
        self.count += 1
        return True


__all__ = ["DRAIN_WEIGHT", "DrainTimes", "EvictionAborts", "MovePatience"]
