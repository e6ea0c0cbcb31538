"""Prometheus plumbing shared by the daemons: the metrics HTTP endpoint and RPC metrics.

Nothing is registered at import time: each daemon builds its metrics into its own
``CollectorRegistry`` (see each daemon's ``metrics.py``).
"""

from __future__ import annotations

import threading
from typing import Any
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

#: Latency buckets for RPCs and other sub-second operations (seconds).
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RpcMetrics:
    """Per-method request counts and latencies of one daemon's gRPC server."""

    def __init__(self, kind: str, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            f"flexmarl_{kind}_rpc_requests_total",
            "gRPC requests handled, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        self.seconds = Histogram(
            f"flexmarl_{kind}_rpc_seconds",
            "gRPC handler latency in seconds, by method.",
            ["method"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        # labels() takes a lock and builds a key per call; an RPC path calls it twice per request.
        self._count_children: dict[tuple[str, str], Any] = {}
        self._seconds_children: dict[str, Any] = {}

    def observe(self, method: str, code: str, seconds: float) -> None:
        """Counts one request of ``method`` that ended with status ``code`` and took ``seconds``."""
        counter = self._count_children.get((method, code))
        if counter is None:
            counter = self._count_children[(method, code)] = self.requests.labels(method, code)
        histogram = self._seconds_children.get(method)
        if histogram is None:
            histogram = self._seconds_children[method] = self.seconds.labels(method)
        counter.inc()
        histogram.observe(seconds)


class MetricsServer:
    """The Prometheus text endpoint of one daemon, on its own port."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._registry = registry
        self._host = host
        self._port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Starts serving in a thread; returns the bound port. Raises OSError if it cannot bind."""
        server, thread = prometheus_client.start_http_server(self._port, addr=self._host, registry=self._registry)
        self._server, self._thread = server, thread
        return int(server.server_port)

    def stop(self) -> None:
        """Stops serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
