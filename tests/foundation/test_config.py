import dataclasses
from pathlib import Path

import pytest

from flexmarl.config import ConfigError, DaemonConfig, etcd_endpoints, load_config


@dataclasses.dataclass(frozen=True)
class _Cfg(DaemonConfig):
    data_dir: str = "d"
    flag: bool = False
    ratio: float = 0.5


def test_defaults() -> None:
    cfg = load_config(_Cfg, [], "x", env={})
    assert cfg.port == 0 and cfg.data_dir == "d" and cfg.etcd_prefix == "/flexmarl"


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("data_dir: from-file\nratio: 0.1\nport: 7000\n")
    env = {"FLEXMARL_DATA_DIR": "from-env", "FLEXMARL_RATIO": "0.2"}
    cfg = load_config(_Cfg, ["--config-file", str(f), "--data-dir", "from-flag", "--flag"], "x", env=env)
    assert cfg.data_dir == "from-flag"
    assert cfg.ratio == 0.2
    assert cfg.port == 7000
    assert cfg.flag is True


def test_env_config_file_and_bool(tmp_path: Path) -> None:
    f = tmp_path / "c.json"
    f.write_text('{"data-dir": "j"}')
    cfg = load_config(_Cfg, [], "x", env={"FLEXMARL_CONFIG_FILE": str(f), "FLEXMARL_FLAG": "yes"})
    assert cfg.data_dir == "j" and cfg.flag is True


@pytest.mark.parametrize(
    ("argv", "env", "match"),
    [
        (["--port", "70000"], {}, "port"),
        (["--port", "abc"], {}, "port: expected int"),
        ([], {"FLEXMARL_RATIO": "x"}, "ratio"),
        ([], {"FLEXMARL_FLAG": "maybe"}, "flag: expected a boolean"),
        (["--etcd-endpoints", "nohost"], {}, "etcd_endpoints"),
        (["--etcd-prefix", "noslash"], {}, "etcd_prefix"),
        (["--registry-ttl-s", "1"], {}, "registry_ttl_s"),
        (["--log-level", "LOUD"], {}, "log_level"),
    ],
)
def test_bad_values(argv: list[str], env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(_Cfg, argv, "x", env=env)


def test_bad_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("nonsense_key: 1\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(_Cfg, ["--config-file", str(f)], "x", env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(_Cfg, ["--config-file", str(tmp_path / "missing.yaml")], "x", env={})


def test_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_config(_Cfg, ["--nope"], "x", env={})
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unrecognized arguments: --nope" in err


def test_masked_hides_secrets() -> None:
    @dataclasses.dataclass(frozen=True)
    class S(DaemonConfig):
        auth_token: str = ""

    cfg = S(auth_token="hunter2")
    assert cfg.masked()["auth_token"] == "***"


def test_etcd_endpoints_parse() -> None:
    assert etcd_endpoints("a:1, b:2") == [("a", 1), ("b", 2)]
