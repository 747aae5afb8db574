"""Prometheus metrics of ``ftd`` (prometheus-client, on its own ``CollectorRegistry``).

A private registry rather than the library's global one: the exposition then holds exactly the daemon's
series (no process/platform collectors of whatever else is imported), and tests can build several daemons'
metrics in one process without "duplicated timeseries" errors.

Series (all prefixed ``ftd_``):

* gauges refreshed after every scan: ``namespaces``, ``generations{state}``, ``bytes_shared`` (sum of the
  sizes of the segments named by the journals, coordinator segments included), ``participants`` (live
  leases), ``registered_participants`` (pidfds watched), ``held_generations``, ``draining_namespaces``;
* counters: ``registrations_total``, ``registration_refusals_total{reason}``, ``deaths_detected_total``
  (registered processes seen exiting while still holding their lease), ``reclaims_total{reason}``
  (``death``: the last registered participant died; ``expired``: the reaper found only expired leases;
  ``orphan``: a journal without coordinator segment; ``release``; ``request``), ``reclaim_errors_total``,
  ``lease_expiries_total`` (ACTIVE slots seen past their lease), ``requests_total{type}``,
  ``bad_frames_total{code}``;
* histogram ``reclaim_latency_seconds``: from the moment the namespace became reclaimable (the death the
  pidfd reported, or the expiry of the last lease) to the end of its cleanup.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:  # pragma: no cover
    from wsgiref.simple_server import WSGIServer

__all__ = ["DaemonMetrics"]

logger = logging.getLogger(__name__)

_STATES = ("INITIALIZING", "READY", "FAILED", "DRAINING", "STALE", "ORPHAN", "CORRUPT")


class DaemonMetrics:
    """Every metric of one daemon, plus the HTTP exposition server when a port is configured."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.namespaces = Gauge("ftd_namespaces", "Namespaces with an ownership journal in the watched lock "
                                "directories", registry=r)
        self.generations = Gauge("ftd_generations", "Generations by state", ["state"], registry=r)
        self.bytes_shared = Gauge("ftd_bytes_shared", "Bytes of /dev/shm segments named by the journals",
                                  registry=r)
        self.participants = Gauge("ftd_participants", "Live lease slots over all namespaces", registry=r)
        self.registered = Gauge("ftd_registered_participants", "Participants watched through a pidfd",
                                registry=r)
        self.held = Gauge("ftd_held_generations", "Generations the daemon holds (ftd hold)", registry=r)
        self.draining = Gauge("ftd_draining_namespaces", "Namespaces marked draining", registry=r)
        self.registrations = Counter("ftd_registrations", "Participant registrations accepted", registry=r)
        self.refusals = Counter("ftd_registration_refusals", "Participant registrations refused", ["reason"],
                                registry=r)
        self.deaths = Counter("ftd_deaths_detected", "Registered processes that exited holding their lease",
                              registry=r)
        self.reclaims = Counter("ftd_reclaims", "Generations reclaimed", ["reason"], registry=r)
        self.reclaim_errors = Counter("ftd_reclaim_errors", "Reclaims that failed (retried next scan)",
                                      registry=r)
        self.reclaim_latency = Histogram(
            "ftd_reclaim_latency_seconds", "From reclaimable (death seen / last lease expired) to cleaned",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=r,
        )
        self.lease_expiries = Counter("ftd_lease_expiries", "Lease slots seen expired (ACTIVE, no heartbeat "
                                      "within the lease)", registry=r)
        self.requests = Counter("ftd_requests", "Requests answered", ["type"], registry=r)
        self.bad_frames = Counter("ftd_bad_frames", "Frames answered with an error before dispatch", ["code"],
                                  registry=r)
        for state in _STATES:
            self.generations.labels(state=state).set(0)
        self.port: int | None = None
        self._server: WSGIServer | None = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the exposition server (a daemon thread); returns the bound port (``port`` 0: any free)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.port = int(server.server_address[1])
        logger.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.shutdown()
            server.server_close()

    def set_generation_states(self, states: Iterable[str]) -> None:
        counts = dict.fromkeys(_STATES, 0)
        for state in states:
            counts[state] = counts.get(state, 0) + 1
        for state, count in counts.items():
            self.generations.labels(state=state).set(count)
