"""The daemons' garbage-collector policy: freeze what start-up built, collect the young generation less often.

CPython's cyclic collector (3.11: three generations, thresholds ``(700, 10, 10)``) runs a
generation-0 collection after every 700 net allocations of container objects and, every 10 of
those, a generation-1 one; a full collection walks every tracked object of the process. A
daemon's start-up leaves hundreds of thousands of objects that live as long as it does
(modules, protobuf descriptors, gRPC and aiohttp machinery, torch in traind), and every full
collection walks them again. Two settings, as long-running Python services do:

* ``gc_freeze`` (default on): once start-up is done, collect, then ``gc.freeze()``: the
  surviving start-up objects move to the permanent generation, which no collection walks.
  Frozen objects are never collected, so this happens once per process (a second call freezes
  nothing), after a full collection (no start-up garbage is frozen), and what the daemon
  allocates afterwards stays in the collector's generations.
* ``gc_gen0_threshold`` (default 50,000): the young generation is collected every 50,000 net
  container allocations instead of 700, so short-lived objects (an RPC's messages, a planner
  call's records) die by reference counting before a collection sees them, and fewer survivors
  are promoted into the older generations (whose collections are the expensive ones). The
  older generations keep CPython's ratios (10, 10). Automatic collection stays on: a
  threshold of 0 (which would turn it off) is refused.

Measured in ``benchmarks.sim`` (docs/benchmarks-scale.md, "Sixth round"), which applies the
same function to its simulated cluster.
"""

from __future__ import annotations

import dataclasses
import gc
import logging

log = logging.getLogger(__name__)

#: CPython's own generation-0 threshold (``gc.get_threshold()[0]`` at interpreter start).
CPYTHON_GEN0_THRESHOLD = 700
#: The daemons' default generation-0 threshold.
DEFAULT_GEN0_THRESHOLD = 50_000


@dataclasses.dataclass(frozen=True)
class GcPolicy:
    """How a process's cyclic garbage collector is tuned once its start-up is done."""

    #: Move the objects alive after start-up into the permanent generation (``gc.freeze()``), once.
    freeze: bool = True
    #: Net container allocations between two young-generation collections (CPython: 700).
    gen0_threshold: int = DEFAULT_GEN0_THRESHOLD

    def __post_init__(self) -> None:
        if self.gen0_threshold < 1:
            raise ValueError(
                f"gc_gen0_threshold: must be >= 1 (0 would turn automatic collection off), got {self.gen0_threshold}"
            )

    @classmethod
    def cpython_default(cls) -> GcPolicy:
        """CPython's own behaviour: nothing frozen, generation 0 collected every 700 allocations."""
        return cls(freeze=False, gen0_threshold=CPYTHON_GEN0_THRESHOLD)


@dataclasses.dataclass(frozen=True)
class GcApplied:
    """What :func:`apply_after_startup` did."""

    #: Objects this call moved to the permanent generation (0 when it froze nothing).
    frozen_objects: int
    #: The collector's thresholds after the call.
    thresholds: tuple[int, int, int]


def apply_after_startup(policy: GcPolicy) -> GcApplied:
    """Applies ``policy`` to this process; call it once start-up is done (a daemon: serving and registered).

    The generation-0 threshold is set (the older generations keep theirs). With ``freeze``, and
    only if nothing is frozen yet, a full collection runs first (so no garbage of start-up is
    frozen, where it could never be freed) and the survivors are frozen; a process that calls
    this again freezes nothing more. Automatic collection is left as it is (on, in a daemon).
    """
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(policy.gen0_threshold, gen1, gen2)
    frozen = 0
    if policy.freeze and gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
    applied = GcApplied(frozen, gc.get_threshold())
    log.info(
        "garbage collector: thresholds %s, %d start-up objects frozen%s",
        applied.thresholds, frozen, "" if policy.freeze else " (freezing off)",
    )
    return applied


def release_frozen() -> None:
    """Returns frozen objects to the oldest generation (``gc.unfreeze()``), so that they can be collected.

    A daemon never needs this (its start-up objects live as long as it does). A process that
    builds and drops several start-ups in turn, as a simulation sweep does, calls it after each,
    so what one of them froze can be collected once it is dropped.
    """
    gc.unfreeze()
