"""The cross-daemon ids: round trips, rejection of malformed ids, and the exact wire format.

The wire strings below are persisted (etcd keys and values, stored rows): they must never change.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexmarl.errors import InvalidArgument
from flexmarl.experience import experience_id, group_id
from flexmarl.ids import (
    JOB_ID_MAX_LENGTH,
    ExperienceKey,
    GroupRef,
    MicroBatchRef,
    StepAttemptRef,
    StepRef,
    TaskRef,
    is_job_id,
    job_id_of_lease,
    lease_id_prefix,
    validate_job_id,
)
from flexmarl.jobspec import JOB_NAME_PATTERN

job_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", fullmatch=True)
agents = st.from_regex(r"[a-z][a-z0-9_-]{0,31}", fullmatch=True)
numbers = st.integers(min_value=0, max_value=10**12)
tasks = st.builds(TaskRef, job_ids, numbers, numbers)
# Group and experience ids accept any task id, not only the planner's.
task_ids = st.one_of(tasks.map(str), st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,40}[A-Za-z0-9]", fullmatch=True))


# ---- the wire format, pinned -------------------------------------------------------------------------


def test_wire_format_is_what_earlier_releases_wrote() -> None:
    assert str(TaskRef("job1", 3, 7)) == "job1/b3/t7"
    assert str(GroupRef("job1/b3/t7", "policy")) == "job1/b3/t7/policy"
    assert str(ExperienceKey("job1/b3/t7", 2, "policy", 0)) == "job1/b3/t7/2/policy/0"
    assert str(StepRef("job1", "policy", 4)) == "job1/policy/step4"
    assert str(StepAttemptRef("job1", "policy", 4, 1)) == "job1/policy/s4/a1"
    assert str(StepAttemptRef("job1", "policy", 4, 1, "9f3a")) == "job1/policy/s4/e9f3a/a1"
    assert str(MicroBatchRef("policy", 4, 1, 2)) == "policy/4/1/2"
    assert lease_id_prefix("job1", "9f3a") == "job1/9f3a-"
    assert job_id_of_lease("job1/9f3a-rollout_task-12") == "job1"


def test_sdk_helpers_delegate_to_the_refs() -> None:
    assert experience_id("t0", 1, "a", 2) == "t0/1/a/2" == str(ExperienceKey("t0", 1, "a", 2))
    assert group_id("t0", "a") == "t0/a" == str(GroupRef("t0", "a"))


def test_parse_reads_the_wire_format() -> None:
    assert TaskRef.parse("job-1.x/b10/t0") == TaskRef("job-1.x", 10, 0)
    assert GroupRef.parse("job1/b3/t7/policy") == GroupRef("job1/b3/t7", "policy")
    assert ExperienceKey.parse("job1/b3/t7/2/policy/0") == ExperienceKey("job1/b3/t7", 2, "policy", 0)
    assert ExperienceKey.parse("job1/b3/t7/2/policy/0").group == GroupRef("job1/b3/t7", "policy")
    assert StepRef.parse("job1/policy/step4") == StepRef("job1", "policy", 4)
    assert StepAttemptRef.parse("job1/policy/s4/e9f3a/a1") == StepAttemptRef("job1", "policy", 4, 1, "9f3a")
    assert StepAttemptRef.parse("job1/policy/s4/a1").step_ref == StepRef("job1", "policy", 4)
    assert MicroBatchRef.parse("policy/4/1/2") == MicroBatchRef("policy", 4, 1, 2)


# ---- round trips ------------------------------------------------------------------------------------


@given(tasks)
def test_task_round_trip(ref: TaskRef) -> None:
    assert TaskRef.parse(str(ref)) == ref
    assert TaskRef.of_job(ref.job_id, str(ref)) == ref
    assert TaskRef.of_job(ref.job_id + "x", str(ref)) is None


@given(task_ids, agents)
def test_group_round_trip(task_id: str, agent: str) -> None:
    ref = GroupRef(task_id, agent)
    assert GroupRef.parse(str(ref)) == ref


@given(task_ids, numbers, agents, numbers)
def test_experience_round_trip(task_id: str, sample: int, agent: str, turn: int) -> None:
    ref = ExperienceKey(task_id, sample, agent, turn)
    assert ExperienceKey.parse(str(ref)) == ref


@given(st.builds(StepRef, job_ids, agents, numbers))
def test_step_round_trip(ref: StepRef) -> None:
    assert StepRef.parse(str(ref)) == ref


@given(st.builds(StepAttemptRef, job_ids, agents, numbers, numbers,
                 st.one_of(st.just(""), st.from_regex(r"[0-9a-f]{1,16}", fullmatch=True))))
def test_step_attempt_round_trip(ref: StepAttemptRef) -> None:
    assert StepAttemptRef.parse(str(ref)) == ref


@given(st.builds(MicroBatchRef, agents, numbers, numbers, numbers))
def test_micro_batch_round_trip(ref: MicroBatchRef) -> None:
    assert MicroBatchRef.parse(str(ref)) == ref


@given(job_ids, st.from_regex(r"[0-9a-f]{1,16}", fullmatch=True), st.integers(min_value=1))
def test_lease_id_names_its_job(job_id: str, epoch: str, number: int) -> None:
    assert job_id_of_lease(f"{lease_id_prefix(job_id, epoch)}rollout_task-{number}") == job_id


# ---- malformed ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "", "job1", "job1/b3", "job1/b3/t", "job1/3/7", "job1/b3/t7/x", "/b3/t7", "job1/b-1/t7", "job1/b03/t7",
    "job1/b3/t7 ", "job/1/b3/t7", "-job/b3/t7", "job1/b٣/t7", f"{'j' * (JOB_ID_MAX_LENGTH + 1)}/b0/t0",
])
def test_malformed_task_ids_are_rejected(text: str) -> None:
    with pytest.raises(InvalidArgument):
        TaskRef.parse(text)
    assert TaskRef.of_job("job1", text) is None


@pytest.mark.parametrize(("parse", "text"), [
    (GroupRef.parse, ""), (GroupRef.parse, "policy"), (GroupRef.parse, "/policy"), (GroupRef.parse, "t0/"),
    (ExperienceKey.parse, "t0/1/a"), (ExperienceKey.parse, "t0/x/a/0"), (ExperienceKey.parse, "1/a/0"),
    (ExperienceKey.parse, "t0/1//0"),
    (StepRef.parse, "job1/policy/s4"), (StepRef.parse, "job1/policy/step"), (StepRef.parse, "job1/step4"),
    (StepRef.parse, "bad job/policy/step4"),
    (StepAttemptRef.parse, "job1/policy/s4"), (StepAttemptRef.parse, "job1/policy/step4/a1"),
    (StepAttemptRef.parse, "job1/policy/s4/e/a1"), (StepAttemptRef.parse, "job1/policy/s4/x9/a1"),
    (MicroBatchRef.parse, "policy/4/1"), (MicroBatchRef.parse, "policy/4/1/x"), (MicroBatchRef.parse, "/4/1/2"),
    (MicroBatchRef.parse, "job1/policy/4/1/2"),
])
def test_malformed_ids_are_rejected(parse: object, text: str) -> None:
    assert callable(parse)
    with pytest.raises(InvalidArgument):
        parse(text)


# ---- the one job-id rule ----------------------------------------------------------------------------


@pytest.mark.parametrize("job_id", ["a", "job-1", "Job_2.x", "9", "j" * JOB_ID_MAX_LENGTH])
def test_good_job_ids(job_id: str) -> None:
    assert is_job_id(job_id)
    validate_job_id(job_id)


@pytest.mark.parametrize("job_id", ["", "-a", ".a", "_a", "a/b", "a b", "é", "j" * (JOB_ID_MAX_LENGTH + 1)])
def test_bad_job_ids(job_id: str) -> None:
    assert not is_job_id(job_id)
    with pytest.raises(InvalidArgument, match="job_id"):
        validate_job_id(job_id)


def test_job_spec_names_follow_the_job_id_rule() -> None:
    assert JOB_NAME_PATTERN == r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def test_eval_task_ids_name_their_round_and_are_never_task_ids() -> None:
    from flexmarl.ids import EvalTaskRef, on_demand_round, periodic_round

    periodic = EvalTaskRef("job-1", periodic_round(2), 5)
    on_demand = EvalTaskRef("job-1", on_demand_round(1), 0)
    assert (str(periodic), str(on_demand)) == ("job-1/ev2/t5", "job-1/ed1/t0")
    assert EvalTaskRef.parse(str(periodic)) == periodic and not periodic.on_demand
    assert EvalTaskRef.parse(str(on_demand)) == on_demand and on_demand.on_demand
    for text in ("job-1/ev2/t5", "job-1/ed1/t0"):
        with pytest.raises(InvalidArgument):
            TaskRef.parse(text)
    for text in ("job-1/b0/t0", "job-1/ex2/t0", "job-1/ev02/t0", "job 1/ev2/t0", "job-1/ev2"):
        with pytest.raises(InvalidArgument):
            EvalTaskRef.parse(text)
