"""Broker configuration: defaults, limits, and the environment overrides."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Config:
    redis_url: str | None = None  # None: start an embedded server
    prefix: str = "fmq"
    host: str = "127.0.0.1"
    port: int = 7379
    password: str | None = None  # clients must AUTH with it when set (it is the `default` user's)
    mqtt_port: int | None = None  # MQTT 3.1.1/5.0 listener (server/mqtt_listener.py); None: off
    mqtt_ws_port: int | None = None  # MQTT over WebSocket (subprotocol mqtt); None: off
    # MQTT sessions (docs/mqtt.md): the longest Session Expiry Interval granted, and what a 3.1.1
    # Clean Session 0 (a session that "never expires") gets
    mqtt_max_session_expiry_s: int = 7 * 24 * 3600
    mqtt_default_session_expiry_s: int = 24 * 3600
    users: bool = False  # clients must AUTH as a user of `fencemq user` (ops/users.py), with its permissions
    # TLS for clients: a certificate chain and its key make the worker listen
    # with TLS only; a CA file also requires client certificates signed by it.
    # (Workers reach Redis over TLS through a rediss:// redis_url.)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    metrics_port: int | None = None
    # The sampled gauges (server/metrics.py): how often, how many queues a sample reads at most, and
    # how many series: one per topic (the largest backlogs first) plus the lmqs with the largest backlogs.
    metrics_sample_ms: int = 15_000
    metrics_scan_limit: int = 10_000
    metrics_max_topics: int = 100
    metrics_top_lmqs: int = 10

    default_lock_ms: int = 30_000
    max_lock_ms: int = 300_000
    max_failures: int = 16  # NACKs before a message is dead-lettered (0 = never)
    retention_maxlen: int = 1_000_000  # messages kept per queue (0 = unbounded)
    retention_maxage_ms: int = 7 * 24 * 3600 * 1000
    dedup_window_ms: int = 120_000
    mailbox_capacity: int = 1024
    lmq_idle_ttl_ms: int = 7 * 24 * 3600 * 1000  # an empty, unowned lmq is reclaimed after this
    journal_cap: int = 10_000  # journal entries kept per queue (one per event or per batch call; 0 = journal off)
    # events kept per lmq: off by default, since a journal costs an lmq at rest
    # ~250 B, more than the rest of it (docs/operations.md, "Lite queues")
    lite_journal_cap: int = 0
    lite_quota: int = 100_000  # lite subscriptions one client may hold per topic

    session_lease_ms: int = 10_000  # a detached or orphaned session ends after this
    sweep_interval_ms: int = 100  # leases come back within this (+ script time) of their deadline
    sweep_batch: int = 1000
    # A fence that makes leases runs at most this long after the lease intent
    # that lists its queue in the schedule (else STALE, and the worker writes a
    # fresh one): what keeps a worker's death between the two from losing a lease.
    lease_intent_ms: int = 1000

    max_payload: int = 1024 * 1024
    max_batch: int = 1000  # messages per MPUB, tags per ACK, COUNT per PULL
    max_args: int = 4096  # arguments in one command
    max_block_ms: int = 300_000

    @property
    def needs_auth(self) -> bool:
        return self.password is not None or bool(self.users)

    @classmethod
    def from_env(cls, **overrides: object) -> "Config":
        """FENCEMQ_<FIELD> environment variables, then explicit overrides."""
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = os.environ.get("FENCEMQ_" + f.name.upper())
            if raw is None:
                continue
            values[f.name] = raw if f.type in ("str", "str | None") else int(raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)
