"""Progress-based leases: a lease is extended only while its work progresses (issue 36, hung workers).

A worker whose renew loop still runs while its work is stuck (a hung engine, a stuck training
step) renews with a progress figure that no longer grows; once it has not grown for longer than
the job's ``leases.progress_timeout_s`` the renewal is refused, the lease ends as expired and the
work is re-issued, and the hung worker's late report is refused. No network, a fake clock.
"""

from __future__ import annotations

import pytest

from flexmarl.errors import FailedPrecondition, InvalidArgument
from orchestratord.leases import LeaseStatus
from orchestratord.planner import MicroBatchWork, Planner, PlannerOptions, WarmStartWork

from .helpers import FakeClock, experiences_for, make_spec
from .test_warm_start_planner import warm_spec

AGENTS = ("sender", "receiver")
BOUND_S = 30.0
RENEW_EVERY_S = 2.0

pytestmark = pytest.mark.timeout(30)


def new_planner(clock: FakeClock, bound_s: float = BOUND_S, job_id: str = "job1") -> Planner:
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    planner.submit_job(job_id, make_spec(leases={"rollout_timeout_s": 10, "train_timeout_s": 20,
                                                 "progress_timeout_s": bound_s}))
    return planner


def test_a_lease_whose_work_progresses_is_renewed_past_the_bound_many_times() -> None:
    clock = FakeClock()
    planner = new_planner(clock)
    lease = planner.lease_rollout_tasks("roll-0", 1)[0]
    for tokens in range(1, 200):  # 398 s, 13x the bound: a token every renewal
        clock.advance(RENEW_EVERY_S)
        result = planner.renew_leases("roll-0", [lease.lease_id], [tokens])
        assert result.lost_lease_ids == () and result.deadline_s == clock.now + 10


def test_a_stalled_task_lease_is_refused_within_the_bound_and_its_task_reissued() -> None:
    clock = FakeClock()
    planner = new_planner(clock)
    stuck, other = planner.lease_rollout_tasks("roll-0", 2)
    clock.advance(RENEW_EVERY_S)
    assert planner.renew_leases("roll-0", [stuck.lease_id, other.lease_id], [5, 5]).lost_lease_ids == ()
    progressed_at_s = clock.now
    # The stuck task's figure stays at 5 (its engine hangs); the other task goes on.
    refused_at_s = None
    for tokens in range(6, 100):
        clock.advance(RENEW_EVERY_S)
        result = planner.renew_leases("roll-0", [stuck.lease_id, other.lease_id], [5, tokens])
        if result.lost_lease_ids:
            assert result.lost_lease_ids == (stuck.lease_id,)
            refused_at_s = clock.now
            break
    assert refused_at_s is not None
    # Refused at the first renewal past the bound: within bound + one renewal interval.
    assert BOUND_S < refused_at_s - progressed_at_s <= BOUND_S + RENEW_EVERY_S
    ended = planner.job("job1")._job.leases.get(stuck.lease_id)
    assert ended is not None and ended.status is LeaseStatus.EXPIRED and "no progress" in ended.end_reason
    # Re-issued at once (not after the lease timeout), to whoever asks first; the late report is refused.
    again = planner.lease_rollout_tasks("roll-1", 1)[0]
    assert again.task_id == stuck.task_id and again.attempt == 2
    with pytest.raises(FailedPrecondition, match="no progress"):
        planner.report_rollout_task(stuck.lease_id, "roll-0", stuck.task_id, True, "",
                                    experiences_for(stuck, AGENTS))
    # A refused lease stays lost, whatever the hung worker sends after it resumes.
    assert planner.renew_leases("roll-0", [stuck.lease_id], [500]).lost_lease_ids == (stuck.lease_id,)
    planner.report_rollout_task(again.lease_id, "roll-1", again.task_id, True, "", experiences_for(again, AGENTS))
    planner.report_rollout_task(other.lease_id, "roll-0", other.task_id, True, "", experiences_for(other, AGENTS))


def test_a_renewal_without_figures_shows_no_progress_and_a_smaller_figure_none_either() -> None:
    clock = FakeClock()
    planner = new_planner(clock)
    bare, shrinking = planner.lease_rollout_tasks("roll-0", 2)
    clock.advance(RENEW_EVERY_S)
    planner.renew_leases("roll-0", [shrinking.lease_id], [100])
    lost: tuple[str, ...] = ()
    for step in range(1, 40):
        clock.advance(RENEW_EVERY_S)
        lost += planner.renew_leases("roll-0", [bare.lease_id]).lost_lease_ids
        lost += planner.renew_leases("roll-0", [shrinking.lease_id], [100 - step]).lost_lease_ids
    assert set(lost) == {bare.lease_id, shrinking.lease_id}


def test_a_bound_of_zero_turns_the_check_off() -> None:
    clock = FakeClock()
    planner = new_planner(clock, bound_s=0)
    lease = planner.lease_rollout_tasks("roll-0", 1)[0]
    for _ in range(300):
        clock.advance(RENEW_EVERY_S)
        assert planner.renew_leases("roll-0", [lease.lease_id]).lost_lease_ids == ()


def test_figures_must_match_the_lease_ids() -> None:
    planner = new_planner(FakeClock())
    a, b = planner.lease_rollout_tasks("roll-0", 2)
    with pytest.raises(InvalidArgument, match="progress"):
        planner.renew_leases("roll-0", [a.lease_id, b.lease_id], [1])


def test_figures_follow_their_leases_across_jobs() -> None:
    clock = FakeClock()
    planner = new_planner(clock, job_id="job1")
    planner.submit_job("job2", make_spec(leases={"rollout_timeout_s": 10, "progress_timeout_s": BOUND_S}))
    leases = planner.lease_rollout_tasks("roll-0", 4)
    by_job = {lease.job_id: lease for lease in leases}
    moving, stuck = by_job["job1"], by_job["job2"]
    lost: set[str] = set()
    for tokens in range(1, 25):
        clock.advance(RENEW_EVERY_S)
        lost.update(planner.renew_leases("roll-0", [stuck.lease_id, moving.lease_id], [3, tokens]).lost_lease_ids)
    assert lost == {stuck.lease_id}


def _first_micro_batch(planner: Planner) -> MicroBatchWork:
    for lease in planner.lease_rollout_tasks("roll", 100):
        if lease.batch_index == 0:
            planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, True, "",
                                        experiences_for(lease, AGENTS))
    work = planner.poll_trainer_work("t0", "s0")
    assert isinstance(work, MicroBatchWork)
    return work


def test_a_stalled_micro_batch_is_replayed_on_another_slot_and_the_late_ack_refused() -> None:
    clock = FakeClock()
    planner = new_planner(clock)
    work = _first_micro_batch(planner)
    lost: tuple[str, ...] = ()
    while not lost:  # traind renews every third of train_timeout_s; its passes stopped at 1
        clock.advance(20 / 3)
        lost = planner.renew_leases("t0", [work.lease_id], [1]).lost_lease_ids
    assert lost == (work.lease_id,)
    assert "s0" not in {slot.slot_id for slot in planner.binder.slots()}, "the hung slot is still bound"
    polled = [planner.poll_trainer_work("t1", slot) for slot in ("s1", "s2")]
    replayed = [w for w in polled if isinstance(w, MicroBatchWork) and w.agent == work.agent]
    assert replayed and replayed[0].step == work.step and replayed[0].lease_id != work.lease_id, polled
    with pytest.raises(FailedPrecondition):
        planner.ack_micro_batch(work.lease_id, "t0", "s0", episodes=work.step_episodes)


def test_a_stalled_warm_start_is_issued_again() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    planner.submit_job("job1", warm_spec("sender", leases={"rollout_timeout_s": 10, "train_timeout_s": 20,
                                                           "progress_timeout_s": BOUND_S}))
    work = planner.poll_trainer_work("t0", "s0")
    assert isinstance(work, WarmStartWork)
    for steps_done in range(1, 4):  # three steps, then it hangs
        clock.advance(5)
        assert planner.renew_leases("t0", [work.lease_id], [steps_done]).lost_lease_ids == ()
    lost: tuple[str, ...] = ()
    while not lost:
        clock.advance(5)
        lost = planner.renew_leases("t0", [work.lease_id], [3]).lost_lease_ids
    again = planner.poll_trainer_work("t1", "s1")
    assert isinstance(again, WarmStartWork) and again.lease_id != work.lease_id
