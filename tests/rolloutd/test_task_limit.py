"""rolloutd's lease limit: ``--max-tasks auto`` sized from the served jobs and live rolloutds, or a fixed number.

The worker's use of it (leases, status, gauge) runs in ``test_worker_link.py`` and, through the
daemon, in ``test_rollout_daemon.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flexmarl.config import ConfigError, load_config
from flexmarl.daemon import DaemonContext
from flexmarl.jobspec import EvaluationSpec, JobSpec, parse_job_spec
from flexmarl.registry import Registry
from rolloutd.app import RolloutApp
from rolloutd.config import RolloutConfig
from rolloutd.task_limit import (
    AUTO_FLOOR,
    DEFAULT_CAP,
    TaskLimit,
    auto_task_limit,
    fewer_tasks_than_admitted,
    tasks_in_flight,
)


def _spec(prompts_per_step: int, max_staleness: int, mode: str = "async") -> JobSpec:
    return parse_job_spec({
        "name": "sizing", "environment": {"entrypoint": "examples.signaling.env:SignalingGame", "config": {}},
        "agents": [{"name": "sender", "model": "tiny://qwen2?seed=1"}],
        "batch": {"prompts_per_step": prompts_per_step, "group_size": 2, "micro_batch_size": 2},
        "pipeline": {"mode": mode, "max_staleness": max_staleness}, "total_steps": 4,
    })


def test_auto_shares_the_jobs_admitted_tasks_among_the_rolloutds_rounded_up_within_floor_and_cap() -> None:
    assert auto_task_limit({}, 1, DEFAULT_CAP) == AUTO_FLOOR == 8  # no job yet
    assert auto_task_limit({"a": 36}, 1, DEFAULT_CAP) == 36
    assert auto_task_limit({"a": 36, "b": 20}, 1, DEFAULT_CAP) == 56  # several jobs: their sum
    assert auto_task_limit({"a": 36, "b": 20}, 3, DEFAULT_CAP) == 19  # 56 / 3 rolloutds, rounded up
    assert auto_task_limit({"a": 36}, 4, DEFAULT_CAP) == 9
    assert auto_task_limit({"a": 36}, 5, DEFAULT_CAP) == 8  # 7.2: the floor
    assert auto_task_limit({"a": 4}, 1, DEFAULT_CAP) == 8
    assert auto_task_limit({"a": 36, "b": 300}, 1, DEFAULT_CAP) == 256  # the cap
    assert auto_task_limit({"a": 36, "b": 300}, 2, 100) == 100
    assert auto_task_limit({"a": 36}, 0, DEFAULT_CAP) == 36  # never divided by no rolloutd


def test_task_limit_follows_jobs_and_rolloutds_and_warns_once_about_a_job_the_cap_clips(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []
    limit = TaskLimit(None, 64, seen.append)
    assert limit.auto and limit.current == 8 and seen == [8]
    eta8 = _spec(4, 8)  # (8 + 1) x 4 = 36
    limit.set_jobs({"j1": eta8})
    assert limit.current == 36
    limit.set_rolloutds(2)
    assert (limit.current, limit.rolloutds) == (18, 2)
    wide = _spec(16, 3)  # 64
    caplog.set_level("WARNING", logger="rolloutd.task_limit")
    limit.set_jobs({"j1": eta8, "j2": wide})  # 100 / 2 = 50
    assert limit.current == 50 and caplog.text == ""
    limit.set_rolloutds(1)  # 100 > cap 64: each job is told once
    assert limit.current == 64
    assert caplog.text.count("job j1: its staleness rule admits 36 tasks at once") == 1
    assert caplog.text.count("job j2: its staleness rule admits 64 tasks at once") == 1
    assert "share of the 2 served job(s)' 100 over 1 live rolloutd(s) is 100, above --max-tasks-cap 64" in caplog.text
    limit.set_jobs({"j1": eta8, "j2": wide})
    assert caplog.text.count("above --max-tasks-cap") == 2  # no repeat while still clipped
    limit.set_jobs({"j1": eta8})  # j2 finished
    assert limit.current == 36
    limit.set_rolloutds(0)  # counted as 1: this rolloutd
    assert limit.rolloutds == 1 and seen == [8, 36, 18, 50, 64, 36]


def test_auto_leaves_room_for_the_eval_task_a_job_with_evaluation_keeps_in_flight() -> None:
    plain = _spec(4, 8)  # 36 training tasks in flight at most
    evaluated = plain.model_copy(update={"evaluation": EvaluationSpec(tasks=16)})
    assert (tasks_in_flight(plain), tasks_in_flight(evaluated)) == (36, 37)
    limit = TaskLimit(None, DEFAULT_CAP, lambda _: None)
    limit.set_jobs({"j1": evaluated})
    assert limit.current == 37  # all 36 training tasks and the round's one eval task at once
    limit.set_jobs({"j1": evaluated, "j2": plain})
    assert limit.current == 73


def test_an_explicit_limit_stays_whatever_the_jobs_and_warns_about_a_job_it_keeps_behind(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []
    limit = TaskLimit(8, DEFAULT_CAP, seen.append)
    caplog.set_level("WARNING", logger="rolloutd.task_limit")
    limit.set_jobs({"j1": _spec(4, 1)})  # admits exactly 8
    assert caplog.text == ""
    limit.set_jobs({"j1": _spec(4, 1), "j2": _spec(4, 8), "j3": _spec(16, 8, mode="sync")})  # sync: eta 0
    limit.set_rolloutds(3)
    assert not limit.auto and limit.current == 8 and seen == [8]
    assert ("job j2: its staleness rule admits 36 tasks at once ((max_staleness 8 + 1) x prompts_per_step 4), "
            "this rolloutd runs at most 8 (--max-tasks 8;") in caplog.text
    assert "job j3: its staleness rule admits 16 tasks" in caplog.text and "job j1" not in caplog.text


def test_the_fixed_limit_warning_says_how_many_steps_of_tasks_it_keeps_in_flight() -> None:
    eta8 = _spec(4, 8)
    assert fewer_tasks_than_admitted(eta8, 36) == ""
    message = fewer_tasks_than_admitted(eta8, 8)
    assert "admits 36 tasks" in message and "at most 8 (--max-tasks 8;" in message and "2 steps" in message
    assert fewer_tasks_than_admitted(_spec(4, 8, mode="sync"), 8) == ""  # a barrier admits one batch


@pytest.mark.parametrize(("flags", "env", "explicit"), [
    ([], {}, None),
    (["--max-tasks", "auto"], {}, None),
    (["--max-tasks", "AUTO"], {}, None),
    (["--max-tasks", "1"], {}, 1),
    (["--max-tasks", "4096"], {}, 4096),
    ([], {"FLEXMARL_MAX_TASKS": "36"}, 36),
    (["--max-tasks", "auto"], {"FLEXMARL_MAX_TASKS": "36"}, None),  # the flag wins
])
def test_max_tasks_is_auto_by_default_or_a_number_from_flag_or_env(
        flags: list[str], env: dict[str, str], explicit: int | None) -> None:
    assert load_config(RolloutConfig, flags, prog="rolloutd", env=env).explicit_max_tasks() == explicit


@pytest.mark.parametrize("value", ["0", "4097", "-3", "eight", "1_6", "1.5", "", "true"])
def test_max_tasks_other_than_auto_or_1_to_4096_is_refused_naming_the_setting(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^max_tasks: must be auto or a number in 1\.\.4096, got "):
        load_config(RolloutConfig, ["--max-tasks", value], prog="rolloutd", env={})


def test_max_tasks_and_its_cap_from_a_config_file(tmp_path: Path) -> None:
    def load(text: str) -> RolloutConfig:
        path = tmp_path / "rolloutd.yaml"
        path.write_text(text)
        return load_config(RolloutConfig, ["--config-file", str(path)], prog="rolloutd", env={})

    assert load("max_tasks: 64\n").explicit_max_tasks() == 64  # a YAML number
    config = load("max_tasks: auto\nmax_tasks_cap: 512\n")
    assert config.explicit_max_tasks() is None and config.max_tasks_cap == 512
    assert load("{}\n").max_tasks_cap == DEFAULT_CAP
    with pytest.raises(ConfigError, match="^max_tasks: must be auto or a number in 1..4096, got 'True'"):
        load("max_tasks: true\n")
    for cap in ("7", "4097"):
        with pytest.raises(ConfigError, match=rf"^max_tasks_cap: must be in 8\.\.4096 .*, got {cap}$"):
            load(f"max_tasks_cap: {cap}\n")


def test_the_worker_settings_follow_the_config(tmp_path: Path) -> None:
    def settings(*flags: str) -> Any:
        config = load_config(RolloutConfig, ["--engine-urls", "http://h:1", "--work-dir", str(tmp_path), *flags],
                             prog="rolloutd", env={})
        ctx = DaemonContext("rolloutd", "r1", config, CollectorRegistry(), Registry(config.etcd_endpoints))
        return RolloutApp(config, ctx).worker.settings

    assert (settings().max_tasks, settings().max_tasks_cap) == (None, DEFAULT_CAP)
    assert (settings("--max-tasks", "12", "--max-tasks-cap", "64").max_tasks,
            settings("--max-tasks-cap", "64").max_tasks_cap) == (12, 64)
