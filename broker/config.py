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
    mqtt_port: int | None = None  # MQTT 3.1.1/5.0 listener (server/mqtt/listener.py); None: off
    mqtt_ws_port: int | None = None  # MQTT over WebSocket (subprotocol mqtt); None: off
    # MQTT sessions (docs/mqtt.md): the longest Session Expiry Interval granted, and what a 3.1.1
    # Clean Session 0 (a session that "never expires") gets
    mqtt_max_session_expiry_s: int = 7 * 24 * 3600
    mqtt_default_session_expiry_s: int = 24 * 3600
    mqtt_server_keep_alive_s: int = 0  # 5.0: the Server Keep Alive every client is given (0: its own Keep Alive)
    users: bool = False  # clients must AUTH as a user of `fencemq user` (ops/users.py), with its permissions
    # TLS for clients: a certificate chain and its key make the worker listen
    # with TLS only; a CA file also requires client certificates signed by it.
    # (Workers reach Redis over TLS through a rediss:// redis_url.)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    metrics_port: int | None = None
    # What a PUB's ids and an ACK's reply promise (fences/durability.py, docs/operations.md):
    # local | replicas=N|all (WAIT) | aof (WAITAOF) | aof+replicas=N|all; past the timeout: UNCONFIRMED
    durability: str = "local"
    durability_timeout_ms: int = 1000
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
    max_delay_ms: int = 400 * 24 * 3600 * 1000  # how far ahead PUB … DELAY | AT may schedule a message
    mailbox_capacity: int = 1024
    lmq_idle_ttl_ms: int = 7 * 24 * 3600 * 1000  # an empty, unowned lmq is reclaimed after this
    journal_cap: int = 10_000  # journal entries kept per queue (one per event or per batch call; 0 = journal off)
    # events kept per lmq: off by default, since a journal costs an lmq at rest
    # ~250 B, more than the rest of it (docs/operations.md, "Lite queues")
    lite_journal_cap: int = 0
    lite_quota: int = 100_000  # lite subscriptions one client may hold per topic

    # Redis memory (fences/memory.py; docs/operations.md, "Redis memory"): publishes are refused (FULL)
    # once a node's memory reaches the high watermark of its limit, until it falls below the low one.
    # A node's limit is its maxmemory; with maxmemory 0, memory_limit_bytes, else the machine's memory
    # as Redis reports it (total_system_memory). Sampled on every node every memory_sample_ms.
    memory_high_watermark: float = 0.9
    memory_low_watermark: float = 0.85
    memory_limit_bytes: int = 0
    memory_sample_ms: int = 500

    # The broker's health and its alarms (server/health_watch.py; docs/ui.md, "Alarms"): one worker at
    # a time reads every Redis node and judges the broker-wide alarms every health_sample_ms; every
    # worker judges its own limits. Each threshold below raises an alarm in the same store as the memory
    # alarms (the `alarms` hash), shown on the overview and the alarms page, exported as fencemq_alarm.
    health_sample_ms: int = 2_000
    # A worker's readers of the broker's totals (the watcher's alarms, the metrics sampler) share one
    # reading, read again once older than this (the history's points read them fresh): on a Cluster a
    # reading is a read of each slot in use (ops/totals.py; docs/ui.md, "Totals")
    totals_read_ms: int = 5_000
    alarm_replication_lag_bytes: int = 1 << 20  # a replica this far behind its primary's offset (1 MiB)
    alarm_replication_lag_s: int = 10  # or whose last acknowledgement is this old
    alarm_min_replicas: int = 0  # a primary with fewer connected replicas (durability replicas=N raises it to N)
    replica_forget_ms: int = 3_600_000  # a replica gone this long is forgotten (its alarm clears)
    worker_forget_ms: int = 600_000  # a worker silent this long is dropped from the workers list (its alarm clears)
    alarm_unacked_age_ms: int = 600_000  # a message some group has not acknowledged, published this long ago
    alarm_dead_letter_growth: int = 100  # this many messages dead-lettered …
    alarm_dead_letter_window_ms: int = 300_000  # … within this window
    alarm_limit_share: float = 0.9  # connections or a session's subscriptions at this share of their limit

    session_lease_ms: int = 10_000  # a detached or orphaned session ends after this
    # SIGTERM drains (docs/operations.md, "Deploying"): clients are told to move and what is in
    # hand is finished within this; what is left is cut
    drain_timeout_ms: int = 5_000
    # where MQTT 5 clients are sent when this worker drains (DISCONNECT's Server Reference, e.g.
    # the balancer's "host:port"); RESP3 clients get it in the draining notice. None: not said
    server_reference: str | None = None
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
    max_arg_bytes: int = 65_536  # any argument but a payload (names, tags, handles, PING's message...)
    max_headers: int = 64  # HDR pairs on one PUB
    max_header_bytes: int = 16_384  # their names and values together
    max_id_bytes: int = 256  # a dedup id (PUB … ID)

    # -- hostile input (docs/security.md, "Limits in force") --------------------------
    # Framing: what one connection may make the worker hold for one request. Past
    # these the connection is closed (the per-command limits above only refuse).
    max_frame_bulk: int = 8 << 20  # one bulk string (at least 2 x max_payload)
    max_frame_args: int = 65_536  # arguments in one frame (at least 2 x max_args)
    # Before authentication a connection may only send tiny frames, as Redis 7 allows
    # unauthenticated clients 10-element multibulks of 16 KiB bulks at most.
    preauth_max_args: int = 10
    preauth_max_bulk: int = 16_384
    auth_timeout_ms: int = 10_000  # an unauthenticated connection is closed after this (0 = never)
    auth_max_failures: int = 3  # failed AUTHs before the connection is closed
    # Each failed AUTH from a client address makes the next one from that address
    # wait: auth_delay_ms, doubled per recent failure, at most auth_delay_max_ms.
    auth_delay_ms: int = 100
    auth_delay_max_ms: int = 5_000
    max_connections: int = 10_000  # per worker, every door counted; past it a new connection is closed
    # MQTT connections (TCP, TLS, WebSocket) in their connect phase at once (the CONNECT read, the session bound and taken up):
    # past it, newly accepted ones wait their turn unread (server/admission.py). A reconnect storm is then
    # taken at a steady rate with full batches, its crowd out of the listen backlog (0 = no bound).
    max_connecting: int = 512
    max_connections_per_user: int = 1_000  # logged-in connections of one user on one worker, every door (0 = no limit)
    # Password checks hash with scrypt (~16 MiB, tens of ms each): at most this many at a time per worker
    # (the others wait their turn; the checks from one address are made one at a time anyway).
    max_password_checks: int = 2
    # Bytes a client may send ahead while one of its commands waits (a long poll): past
    # this the connection stops reading until the command is done, and TCP holds the rest.
    max_read_ahead: int = 4 << 20
    # A client that does not read its replies: a write still waiting for room after
    # this long closes the connection (the worker holds one batch of replies at most).
    output_timeout_ms: int = 30_000
    # A request begun and not finished within this closes the connection (slowloris);
    # a connection between requests may idle for idle_timeout_ms (0 = for ever, as
    # Redis: SDK clients hold connections open without traffic).
    request_timeout_ms: int = 30_000
    idle_timeout_ms: int = 0
    tls_handshake_timeout_ms: int = 10_000
    max_subscriptions: int = 10_000  # subscriptions one session holds, lite ones (see lite_quota) apart

    @property
    def frame_bulk_limit(self) -> int:
        return max(self.max_frame_bulk, 2 * self.max_payload)

    @property
    def frame_args_limit(self) -> int:
        return max(self.max_frame_args, 2 * self.max_args)

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
            if f.type in ("str", "str | None"):
                values[f.name] = raw
            else:
                values[f.name] = float(raw) if f.type == "float" else int(raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)
