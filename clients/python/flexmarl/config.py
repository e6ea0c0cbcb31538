"""Daemon configuration: a frozen dataclass built from flags, env and a file.

Precedence, highest first: command-line flag, ``FLEXMARL_<FIELD>`` environment
variable, the optional config file (YAML or JSON, keys are field names), the
field's default. Every field of the dataclass is one ``--kebab-case`` flag.
Validation raises :class:`ConfigError` with one line naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from flexmarl.gc_policy import DEFAULT_GEN0_THRESHOLD

ENV_PREFIX = "FLEXMARL_"
_SECRET_MARKERS = ("token", "password", "secret", "key_file")
#: Fields that name a file holding a secret: the path is shown, the file's contents never enter the config.
_SECRET_PATH_FIELDS = frozenset({"auth_token_file", "etcd_password_file"})


class ConfigError(Exception):
    """A configuration value is missing, malformed or out of range."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    """Settings every daemon shares."""

    host: str = dataclasses.field(default="127.0.0.1", metadata=_help("address the gRPC server binds"))
    port: int = dataclasses.field(default=0, metadata=_help("gRPC port; 0 lets the OS choose"))
    metrics_port: int = dataclasses.field(
        default=0, metadata=_help("Prometheus metrics HTTP port; 0 lets the OS choose, -1 disables")
    )
    metrics_host: str = dataclasses.field(default="127.0.0.1", metadata=_help("metrics HTTP bind address"))
    advertise_host: str = dataclasses.field(
        default="", metadata=_help("host other daemons use to reach this one (default: --host)")
    )
    service_id: str = dataclasses.field(default="", metadata=_help("registry id (default kind-host-pid)"))
    etcd_endpoints: str = dataclasses.field(
        default="127.0.0.1:2379", metadata=_help("comma-separated etcd host:port list")
    )
    etcd_prefix: str = dataclasses.field(default="/flexmarl", metadata=_help("key prefix in etcd"))
    etcd_connect_timeout_s: float = dataclasses.field(
        default=5.0, metadata=_help("give up starting when etcd is unreachable this long")
    )
    etcd_ca: str = dataclasses.field(
        default="", metadata=_help("PEM CA bundle: connect to etcd over TLS and verify its certificate with it")
    )
    etcd_cert: str = dataclasses.field(
        default="", metadata=_help("PEM client certificate presented to etcd (with --etcd-key; needs --etcd-ca)")
    )
    etcd_key: str = dataclasses.field(default="", metadata=_help("PEM private key of --etcd-cert"))
    etcd_username: str = dataclasses.field(
        default="", metadata=_help("etcd user to authenticate as (etcd auth enabled; with --etcd-password-file)")
    )
    etcd_password_file: str = dataclasses.field(
        default="", metadata=_help("file holding the etcd user's password (never give the password itself)")
    )
    etcd_server_name: str = dataclasses.field(
        default="", metadata=_help("name every etcd member's TLS certificate is checked against (default: the "
                                   "first endpoint's host; with several members, a name their certificates share)")
    )
    registry_ttl_s: int = dataclasses.field(default=10, metadata=_help("TTL of the registration lease"))
    log_level: str = dataclasses.field(default="INFO", metadata=_help("DEBUG, INFO, WARNING or ERROR"))
    grace_s: float = dataclasses.field(default=5.0, metadata=_help("drain time on SIGTERM"))
    max_message_bytes: int = dataclasses.field(
        default=64 * 1024 * 1024, metadata=_help("gRPC max send/receive message size")
    )
    ready_file: str = dataclasses.field(
        default="", metadata=_help("write {grpc_port, metrics_port, pid, service_id} JSON here once serving")
    )
    config_file: str = dataclasses.field(default="", metadata=_help("YAML or JSON file of settings"))
    tls_cert: str = dataclasses.field(
        default="", metadata=_help("PEM server certificate: serve gRPC over TLS (with --tls-key)")
    )
    tls_key: str = dataclasses.field(default="", metadata=_help("PEM private key of --tls-cert"))
    tls_ca: str = dataclasses.field(
        default="", metadata=_help("PEM CA bundle: connect to peers over TLS and verify them with it")
    )
    tls_require_client_cert: bool = dataclasses.field(
        default=False, metadata=_help("mutual TLS: refuse clients without a certificate signed by --tls-ca")
    )
    auth_token_file: str = dataclasses.field(
        default="", metadata=_help("file holding the bearer token required on calls and sent to peers")
    )
    gc_freeze: bool = dataclasses.field(
        default=True,
        metadata=_help("once serving, move the objects start-up left into the collector's permanent generation "
                       "(gc.freeze(), once; flexmarl/gc_policy.py)"),
    )
    gc_gen0_threshold: int = dataclasses.field(
        default=DEFAULT_GEN0_THRESHOLD,
        metadata=_help("net container allocations between young-generation collections (CPython's default: 700; "
                       ">= 1, automatic collection stays on)"),
    )

    def validate(self) -> None:
        """Raises ConfigError on an out-of-range value; subclasses extend it."""
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not -1 <= value <= 65535 or (name == "port" and value < 0):
                raise ConfigError(f"{name}: {value} is not a valid port")
        if self.registry_ttl_s < 2:
            raise ConfigError(f"registry_ttl_s: must be >= 2, got {self.registry_ttl_s}")
        if self.grace_s < 0:
            raise ConfigError(f"grace_s: must be >= 0, got {self.grace_s}")
        if self.max_message_bytes < 1024 * 1024:
            raise ConfigError(f"max_message_bytes: must be >= 1 MiB, got {self.max_message_bytes}")
        if self.gc_gen0_threshold < 1:
            raise ConfigError(
                f"gc_gen0_threshold: must be >= 1 (0 would turn automatic collection off), got {self.gc_gen0_threshold}"
            )
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: unknown level {self.log_level!r}")
        if not self.etcd_prefix.startswith("/") or self.etcd_prefix.endswith("/"):
            raise ConfigError(f"etcd_prefix: must start with '/' and not end with it, got {self.etcd_prefix!r}")
        etcd_endpoints(self.etcd_endpoints)
        self._validate_security()

    def _validate_security(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert/tls_key: give both or neither")
        if self.tls_require_client_cert and not (self.tls_ca and self.tls_cert):
            raise ConfigError("tls_require_client_cert: needs tls_ca, tls_cert and tls_key")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ConfigError("etcd_cert/etcd_key: give both or neither")
        if self.etcd_cert and not self.etcd_ca:
            raise ConfigError("etcd_cert: needs etcd_ca (the CA that signed etcd's certificate)")
        if bool(self.etcd_username) != bool(self.etcd_password_file):
            raise ConfigError("etcd_username/etcd_password_file: give both or neither")
        if self.etcd_server_name and not self.etcd_ca:
            raise ConfigError("etcd_server_name: needs etcd_ca (the name is checked only over TLS)")
        for name in ("tls_cert", "tls_key", "tls_ca", "auth_token_file", "etcd_ca", "etcd_cert", "etcd_key",
                     "etcd_password_file"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{name}: cannot read {path}")
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: {path} is not a file")

    def masked(self) -> dict[str, Any]:
        """The settings as a dict with secrets replaced, for the start-up log line."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value and f.name not in _SECRET_PATH_FIELDS and any(m in f.name for m in _SECRET_MARKERS):
                value = "***"
            out[f.name] = value
        return out


C = TypeVar("C", bound=DaemonConfig)


def etcd_endpoints(text: str) -> list[tuple[str, int]]:
    """Parses "host:port,host:port" into pairs; raises ConfigError when malformed."""
    pairs: list[tuple[str, int]] = []
    for item in text.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"etcd_endpoints: {item.strip()!r} is not host:port")
        pairs.append((host, int(port)))
    return pairs


class _OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line and exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _field_type(cls: type, f: dataclasses.Field[Any]) -> type:
    hints = typing.get_type_hints(cls)
    hint = hints[f.name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint not in (str, int, float, bool):
        raise TypeError(f"config field {f.name}: unsupported type {hint!r}")
    return typing.cast(type, hint)


def _convert(name: str, kind: type, raw: Any) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{name}: expected a boolean, got {raw!r}")
    if kind in (int, float) and isinstance(raw, bool):
        raise ConfigError(f"{name}: expected a number, got {raw!r}")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected {kind.__name__}, got {raw!r}") from None


def build_parser(cls: type[C], prog: str, description: str = "") -> argparse.ArgumentParser:
    """An argument parser with one --flag per config field (defaults left unset)."""
    parser = _OneLineParser(prog=prog, description=description or (cls.__doc__ or ""))
    for f in dataclasses.fields(cls):
        kind = _field_type(cls, f)
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {f.default!r}]"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text, metavar=kind.__name__.upper())
    return parser


def _read_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"config_file: cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"config_file: {path} is not valid YAML/JSON: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config_file: {path} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def load_config(
    cls: type[C],
    argv: Sequence[str] | None,
    prog: str,
    env: Mapping[str, str] | None = None,
    description: str = "",
) -> C:
    """Builds and validates a config; raises ConfigError (argparse exits 2 on bad flags)."""
    env = os.environ if env is None else env
    args = vars(build_parser(cls, prog, description).parse_args(argv))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    config_file = args.get("config_file") or env.get(ENV_PREFIX + "CONFIG_FILE", "")
    from_file = _read_file(config_file) if config_file else {}
    unknown = sorted(set(from_file) - set(fields))
    if unknown:
        raise ConfigError(f"config_file: unknown setting(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        kind = _field_type(cls, f)
        env_key = ENV_PREFIX + name.upper()
        if args.get(name) is not None:
            values[name] = _convert(name, kind, args[name])
        elif env_key in env:
            values[name] = _convert(name, kind, env[env_key])
        elif name in from_file:
            values[name] = _convert(name, kind, from_file[name])
    config = cls(**values)
    config.validate()
    return config
