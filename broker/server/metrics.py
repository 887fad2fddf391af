"""Prometheus counters a worker exports (``fencemq serve --metrics-port``)."""

from prometheus_client import Counter, Gauge

COMMANDS = Counter("fencemq_commands_total", "Commands handled", ["verb"])
ERRORS = Counter("fencemq_errors_total", "Error replies sent", ["code"])
PUBLISHED = Counter("fencemq_published_total", "Messages published")
DELIVERED = Counter("fencemq_delivered_total", "Messages checked out to consumers")
ACKED = Counter("fencemq_acked_total", "Checkouts settled by ACK")
LEASE_TIMEOUTS = Counter("fencemq_lease_timeouts_total", "Checkouts returned because their lease expired")
RENEWALS = Counter("fencemq_renewals_total", "Leases extended by RENEW")
SUSPICIONS = Counter("fencemq_suspicions_total", "Consumers marked suspected after a lease expiry")
SESSIONS_EXPIRED = Counter("fencemq_sessions_expired_total", "Sessions ended by lease expiry")
CONNECTIONS = Gauge("fencemq_connections", "Open client connections")
