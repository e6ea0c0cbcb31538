"""The daemons' GC policy (flexmarl/gc_policy.py): frozen once after start-up, young generation less often, never off.

Each check runs in its own interpreter: freezing pytest's own heap would keep it from the collector for the
rest of the session.
"""

import subprocess
import sys
import textwrap

import pytest

from flexmarl.gc_policy import CPYTHON_GEN0_THRESHOLD, DEFAULT_GEN0_THRESHOLD, GcPolicy

pytestmark = pytest.mark.timeout(60)

SCRIPT = textwrap.dedent("""
    import gc, weakref
    from flexmarl.gc_policy import GcPolicy, apply_after_startup, release_frozen

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    started = [Node() for _ in range(1000)]  # what start-up keeps
    garbage = cycle()  # start-up's garbage: collected before the freeze, never frozen
    first = apply_after_startup(GcPolicy())
    assert garbage() is None, "start-up's garbage was frozen"
    # Reference counting still frees a frozen object whose last reference goes: the count only falls.
    assert first.frozen_objects > 1000 and 0 < gc.get_freeze_count() <= first.frozen_objects
    assert first.thresholds == (50_000, 10, 10) and gc.isenabled()
    frozen = gc.get_freeze_count()
    again = apply_after_startup(GcPolicy(gen0_threshold=20_000))
    assert again.frozen_objects == 0 and gc.get_freeze_count() <= frozen, "froze twice"
    assert again.thresholds == (20_000, 10, 10)
    later = cycle()  # the daemon's run-time garbage stays collectable
    gc.collect()
    assert later() is None
    release_frozen()
    assert gc.get_freeze_count() == 0
    print("ok")
""")

CPYTHON = textwrap.dedent("""
    import gc
    from flexmarl.gc_policy import GcPolicy, apply_after_startup
    applied = apply_after_startup(GcPolicy.cpython_default())
    assert applied.frozen_objects == 0 and gc.get_freeze_count() == 0
    assert applied.thresholds == (700, 10, 10) and gc.isenabled()
    print("ok")
""")


@pytest.mark.parametrize("script", [SCRIPT, CPYTHON], ids=["daemon", "cpython"])
def test_the_policy_in_a_fresh_interpreter(script: str) -> None:
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_threshold_of_zero_is_refused_and_the_defaults_are_named() -> None:
    with pytest.raises(ValueError, match="gc_gen0_threshold: must be >= 1"):
        GcPolicy(gen0_threshold=0)
    assert GcPolicy() == GcPolicy(freeze=True, gen0_threshold=DEFAULT_GEN0_THRESHOLD)
    assert GcPolicy.cpython_default() == GcPolicy(freeze=False, gen0_threshold=CPYTHON_GEN0_THRESHOLD)
