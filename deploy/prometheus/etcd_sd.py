#!/usr/bin/env python3
"""Prometheus file_sd targets for the FlexMARL daemons registered in etcd.

Every daemon registers ``<prefix>/services/<kind>/<id>`` in etcd with its gRPC address and
its metrics port. This script lists those records and writes them as a Prometheus
``file_sd_configs`` JSON file: one target group per daemon, ``<host>:<metrics_port>`` with the
labels ``kind``, ``service_id`` and ``flexmarl_cluster`` (the etcd prefix). The host is the
host part of the advertised gRPC address, so set ``metrics_host: 0.0.0.0`` (or the node's
address) on daemons that Prometheus scrapes from another machine. Daemons with metrics
disabled (port -1) are left out.

The file is replaced atomically, so Prometheus never reads a partial file. With
``--interval-s 0`` it writes once and exits; otherwise it rewrites the file every interval
until SIGTERM. Exit codes: 0 done, 1 etcd unreachable (in one-shot mode), 2 bad arguments.

    python deploy/prometheus/etcd_sd.py --etcd-endpoints etcd-0:2379 --out /var/lib/flexmarl-sd/prod.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexmarl.config import ConfigError, etcd_endpoints
from flexmarl.errors import Unavailable
from flexmarl.registry import ETCD_ERRORS, PLAINTEXT_ETCD, EtcdSecurity, Registry, ServiceRecord

log = logging.getLogger("etcd_sd")


def target_groups(services: Sequence[ServiceRecord], prefix: str) -> list[dict[str, Any]]:
    """file_sd target groups, one per daemon with a metrics port, sorted by kind and id."""
    groups: list[dict[str, Any]] = []
    for record in sorted(services, key=lambda r: (r.kind, r.service_id)):
        if record.metrics_port <= 0:
            continue
        host = record.address.rpartition(":")[0] or "127.0.0.1"
        groups.append({
            "targets": [f"{host}:{record.metrics_port}"],
            "labels": {"kind": record.kind, "service_id": record.service_id, "flexmarl_cluster": prefix},
        })
    return groups


def write_atomically(path: Path, groups: list[dict[str, Any]]) -> bool:
    """Writes the targets file via a rename; returns False when the content did not change."""
    text = json.dumps(groups, indent=2, sort_keys=True) + "\n"
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


async def list_services(
    endpoints: str, prefix: str, timeout_s: float, security: EtcdSecurity = PLAINTEXT_ETCD
) -> list[ServiceRecord]:
    """Every registered daemon; raises Unavailable when etcd does not answer."""
    registry = Registry(endpoints, prefix, connect_timeout_s=timeout_s, request_timeout_s=timeout_s,
                        security=security)
    await registry.connect()
    try:
        return await registry.list_services()
    except ETCD_ERRORS as exc:
        raise Unavailable(f"etcd: cannot list services: {type(exc).__name__} {exc}") from None
    finally:
        await registry.close()


async def run(
    endpoints: str, prefix: str, out: Path, interval_s: float, timeout_s: float,
    security: EtcdSecurity = PLAINTEXT_ETCD,
) -> int:
    """Writes the targets once (interval_s == 0) or every interval_s until SIGTERM/SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    while True:
        try:
            services = await list_services(endpoints, prefix, timeout_s, security)
        except Unavailable as exc:
            if interval_s <= 0:
                print(f"etcd_sd: {exc}", file=sys.stderr)
                return 1
            # Keep the last good file: Prometheus keeps scraping the daemons it knew.
            log.warning("%s; keeping %s", exc, out)
        else:
            groups = target_groups(services, prefix)
            if write_atomically(out, groups):
                log.info("%d targets written to %s", len(groups), out)
        if interval_s <= 0:
            return 0
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
        if stop.is_set():
            return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parses arguments (defaults from the daemons' FLEXMARL_* variables) and runs."""
    parser = argparse.ArgumentParser(prog="etcd_sd", description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--etcd-endpoints", default=os.environ.get("FLEXMARL_ETCD_ENDPOINTS", "127.0.0.1:2379"),
                        help="comma-separated etcd host:port list [env FLEXMARL_ETCD_ENDPOINTS]")
    parser.add_argument("--etcd-prefix", default=os.environ.get("FLEXMARL_ETCD_PREFIX", "/flexmarl"),
                        help="key prefix of the cluster [env FLEXMARL_ETCD_PREFIX]")
    parser.add_argument("--out", required=True, type=Path, help="file_sd JSON file to write")
    parser.add_argument("--interval-s", type=float, default=0.0, help="rewrite period; 0 = write once and exit")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="etcd connect/request timeout")
    for name, text in _ETCD_SECURITY_FLAGS:
        env = f"FLEXMARL_{name.upper()}"
        parser.add_argument("--" + name.replace("_", "-"), default=os.environ.get(env, ""), help=f"{text} [env {env}]")
    args = parser.parse_args(argv)
    try:
        etcd_endpoints(args.etcd_endpoints)
        security = EtcdSecurity.from_files(ca=args.etcd_ca, cert=args.etcd_cert, key=args.etcd_key,
                                           username=args.etcd_username, password_file=args.etcd_password_file)
    except ConfigError as exc:
        parser.exit(2, f"etcd_sd: error: {exc}\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(args.etcd_endpoints, args.etcd_prefix, args.out, args.interval_s, args.timeout_s,
                           security))


#: etcd TLS/auth settings, named and read from the environment as the daemons' (flexmarl.config).
_ETCD_SECURITY_FLAGS = (
    ("etcd_ca", "CA bundle: reach etcd over TLS"),
    ("etcd_cert", "client certificate for etcd (with --etcd-key)"),
    ("etcd_key", "private key of --etcd-cert"),
    ("etcd_username", "etcd user (with --etcd-password-file)"),
    ("etcd_password_file", "file holding the etcd user's password"),
)


if __name__ == "__main__":
    raise SystemExit(main())
