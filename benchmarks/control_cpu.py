"""CPU of the real control-plane code a simulation drives (``benchmarks.sim``): thread time per component."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any


class CpuMeter:
    """Thread CPU seconds spent inside the real control-plane code the simulation calls.

    :meth:`wrap` replaces an object's public methods, on the instance only (its type stays the
    real class), by ones that add ``time.thread_time()`` around the call to the object's
    component ("planner", "balancer"). Only the outermost call is timed, so a public method
    calling another is not counted twice. The meter's own two clock reads per call (well under a
    microsecond each) fall inside the figure: an upper bound, not a discount.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        #: The same per outermost method, ``component.method`` (what a profile of the figure starts from).
        self.method_seconds: dict[str, float] = {}
        self.method_calls: dict[str, int] = {}
        self._depth = 0

    @property
    def inside(self) -> bool:
        """Whether a timed call is running now (a garbage collection now is counted in its CPU)."""
        return self._depth > 0

    def wrap(self, component: str, target: object) -> None:
        """Times every public method of ``target`` (defined on its class) as ``component``."""
        self.seconds.setdefault(component, 0.0)
        self.calls.setdefault(component, 0)
        for name in dir(type(target)):
            if name.startswith("_") or not inspect.isfunction(inspect.getattr_static(type(target), name)):
                continue
            setattr(target, name, self._timed(component, getattr(target, name)))

    def _timed(self, component: str, method: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time
        label = f"{component}.{method.__name__}"
        self.method_seconds.setdefault(label, 0.0)
        self.method_calls.setdefault(label, 0)

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            started = clock()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed_s = clock() - started
                self.seconds[component] += elapsed_s
                self.calls[component] += 1
                self.method_seconds[label] += elapsed_s
                self.method_calls[label] += 1
                self._depth -= 1

        return timed
