"""The health of every Redis node the broker lives on: what the overview, the alarms and Prometheus show.

Every byte of the broker's state is in Redis, so its nodes' health is the
broker's: memory against ``maxmemory`` and the eviction policy, fragmentation,
evictions, operations per second, the round trip of a PING, persistence
(the last RDB save, the AOF's last write), the role and, for a replica, how
far its replication offset trails its primary's; on a Cluster, each node's
view of the slots (``CLUSTER INFO``) and its flags (``CLUSTER NODES``).

Which nodes: a Cluster's every node, primaries and replicas, from ``CLUSTER
NODES``; otherwise the primary the client reaches (directly or through
Sentinel) and the replicas its ``INFO replication`` lists. A replica that is
gone is not listed by its primary: the health watcher of the workers
(server/health_watch.py) remembers the replicas it saw (``redis_nodes``), and
a remembered one that no longer answers is shown down. Each node other than
the client's own is read through a small client of its own (one connection,
1 s timeouts), so a node that hangs costs a second, not a stuck page.

Reads only, like the rest of broker/ops/: nothing here writes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import SentinelConnectionPool

from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.model.keys import Keyspace
from fencemq.model.values import text

NODE_TIMEOUT_S = 1.0
# What a node's own client may carry over from the broker's (credentials, TLS)
CARRIED = ("username", "password", "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_data",
           "ssl_check_hostname", "ssl_ca_path", "ssl_min_version", "ssl_ciphers")


@dataclass
class NodeHealth:
    """One node, as it answered (``up``) or why it did not (``error``)."""

    node: str  # host:port
    role: str  # primary | replica
    primary: str | None = None  # a replica's primary (its shard); None for a primary
    up: bool = True
    error: str | None = None
    version: str = ""
    used_memory: int = 0  # as counted against maxmemory
    maxmemory: int = 0  # 0: no limit
    policy: str = ""
    fragmentation: float | None = None  # mem_fragmentation_ratio: RSS / used
    evicted_keys: int = 0
    ops_per_sec: int = 0
    latency_ms: float | None = None  # a PING's round trip from the reader
    rdb_ok: bool | None = None  # the last RDB save succeeded (None: never saved)
    rdb_changes: int = 0  # writes since the last save
    last_save_s: float | None = None  # since the last successful save
    aof_enabled: bool = False
    aof_ok: bool | None = None  # the AOF's last write succeeded (None: AOF off)
    loading: bool = False
    repl_offset: int | None = None  # its replication offset
    replicas: int = 0  # connected replicas (a primary)
    link_up: bool | None = None  # a replica's link to its primary
    lag_bytes: int | None = None  # a replica: how far its offset trails its primary's
    lag_s: float | None = None  # a replica: seconds since its last acknowledgement, as its primary sees it
    cluster_state: str | None = None  # a Cluster node's view: ok | fail
    slots_assigned: int | None = None
    slots_ok: int | None = None
    slots_pfail: int | None = None
    slots_fail: int | None = None
    flags: str = ""  # a Cluster node's flags (fail, fail?, handshake…)

    @property
    def memory_share(self) -> float | None:
        return self.used_memory / self.maxmemory if self.maxmemory else None

    @property
    def persistence_ok(self) -> bool:
        return self.rdb_ok is not False and self.aof_ok is not False

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory_share"] = self.memory_share
        out["persistence_ok"] = self.persistence_ok
        return out


@dataclass
class Health:
    """Every node, primaries first (each followed by its replicas), and how the broker reaches them."""

    mode: str  # single | sentinel | cluster
    nodes: list[NodeHealth] = field(default_factory=list)
    read_ms: int = 0
    sentinel: dict[str, Any] | None = None  # Sentinel's view of the primary: flags, replicas it knows

    @property
    def primaries(self) -> list[NodeHealth]:
        return [n for n in self.nodes if n.role == "primary"]

    def replicas_of(self, primary: str) -> list[NodeHealth]:
        return [n for n in self.nodes if n.role == "replica" and n.primary == primary]

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "read_ms": self.read_ms, "sentinel": self.sentinel,
                "nodes": [n.as_dict() for n in self.nodes]}


def _int(info: dict[str, Any], name: str, default: int = 0) -> int:
    try:
        return int(info.get(name, default))
    except (TypeError, ValueError):
        return default


def _float(info: dict[str, Any], name: str) -> float | None:
    try:
        return float(info[name])
    except (KeyError, TypeError, ValueError):
        return None


def read_info(n: NodeHealth, info: dict[str, Any], now_s: float) -> None:
    """Fill ``n`` from a node's ``INFO`` (every section)."""
    n.version = text(info.get("redis_version") or info.get("valkey_version") or "")
    n.used_memory = max(0, _int(info, "used_memory") - _int(info, "mem_not_counted_for_evict"))
    n.maxmemory = _int(info, "maxmemory")
    n.policy = text(info.get("maxmemory_policy") or "")
    n.fragmentation = _float(info, "mem_fragmentation_ratio")
    n.evicted_keys = _int(info, "evicted_keys")
    n.ops_per_sec = _int(info, "instantaneous_ops_per_sec")
    status = text(info.get("rdb_last_bgsave_status") or "")
    saved = _int(info, "rdb_last_save_time")
    n.rdb_ok = None if status == "" else status == "ok"
    n.rdb_changes = _int(info, "rdb_changes_since_last_save")
    n.last_save_s = round(now_s - saved, 1) if saved else None
    n.aof_enabled = _int(info, "aof_enabled") == 1
    n.aof_ok = (text(info.get("aof_last_write_status") or "ok") == "ok") if n.aof_enabled else None
    n.loading = _int(info, "loading") == 1
    role = text(info.get("role") or "master")
    if role == "master":
        n.role = "primary"
        n.repl_offset = _int(info, "master_repl_offset")
        n.replicas = _int(info, "connected_slaves")
    else:
        n.role = "replica"
        n.repl_offset = _int(info, "slave_repl_offset", _int(info, "master_repl_offset"))
        n.link_up = text(info.get("master_link_status") or "") == "up"
        host, port = info.get("master_host"), info.get("master_port")
        if host and n.primary is None:
            n.primary = f"{text(host)}:{port}"


def listed_replicas(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``slaveN`` lines of a primary's INFO: ip, port, state, offset, lag (redis-py parses them)."""
    out = []
    for i in range(_int(info, "connected_slaves")):
        line = info.get(f"slave{i}")
        if isinstance(line, dict):
            out.append(line)
        elif isinstance(line, str):  # not parsed: "ip=…,port=…,state=…,offset=…,lag=…"
            out.append(dict(part.split("=", 1) for part in line.split(",") if "=" in part))
    return out


def parse_cluster_nodes(reply: Any) -> list[dict[str, Any]]:
    """``CLUSTER NODES`` (raw text, or redis-py's parsed dict) as {node, id, flags, primary_id, connected}."""
    out = []
    if isinstance(reply, dict):
        for address, v in reply.items():
            out.append({"node": text(address).split("@")[0], "id": text(v.get("node_id", "")),
                        "flags": text(v.get("flags", "")), "primary_id": text(v.get("master_id", "-")),
                        "connected": bool(v.get("connected", True))})
        return out
    for line in text(reply).splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        out.append({"node": parts[1].split("@")[0].split(",")[0], "id": parts[0], "flags": parts[2],
                    "primary_id": parts[3], "connected": parts[7] == "connected"})
    return out


async def remembered_nodes(redis: Any, keys: Keyspace) -> dict[str, dict[str, Any]]:
    """The nodes the health watcher has seen (``redis_nodes``): address -> {role, primary, seen_ms}."""
    out = {}
    # (HSCAN, not HGETALL: a background reader stays out of what HGETALL's statistics measure)
    found: dict[Any, Any] = {}
    cursor = 0
    while True:
        cursor, part = await redis.hscan(keys.redis_nodes, cursor, count=1000)
        found.update(part)
        if int(cursor) == 0:
            break
    for k, v in found.items():
        try:
            out[text(k)] = json.loads(v)
        except ValueError:
            continue
    return out


class HealthReader:
    """Reads :class:`Health` through the broker's client; keeps one small client per other node."""

    def __init__(self, redis: Any, keys: Keyspace, url: str | None = None) -> None:
        self.redis, self.keys, self.url = redis, keys, url
        self._clients: dict[str, Redis] = {}

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()

    # -- clients --------------------------------------------------------------------------------

    def _options(self) -> dict[str, Any]:
        if isinstance(self.redis, RedisCluster):
            nodes = self.redis.get_nodes()
            kwargs = dict(nodes[0].connection_kwargs) if nodes else {}
            cls = nodes[0].connection_class if nodes else None
        else:
            kwargs, cls = dict(self.redis.connection_pool.connection_kwargs), self.redis.connection_pool.connection_class
        out = {k: kwargs[k] for k in CARRIED if kwargs.get(k) is not None}
        if cls is not None and issubclass(cls, SSLConnection):
            out["ssl"] = True
        return out

    def _client(self, node: str) -> Redis:
        c = self._clients.get(node)
        if c is None:
            host, _, port = node.rpartition(":")
            c = Redis(host=host, port=int(port), socket_timeout=NODE_TIMEOUT_S,
                      socket_connect_timeout=NODE_TIMEOUT_S, max_connections=1, **self._options())
            self._clients[node] = c
        return c

    async def _primary_address(self) -> str:
        pool = self.redis.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            host, port = await pool.get_master_address()
            return f"{host}:{port}"
        kwargs = pool.connection_kwargs
        if kwargs.get("host"):
            return f"{kwargs['host']}:{kwargs.get('port', 6379)}"
        return text(kwargs.get("path") or "redis")

    async def _look(self, n: NodeHealth, client: Any, now_s: float, cluster: bool = False) -> dict[str, Any] | None:
        """PING (timed), INFO and, on a Cluster, CLUSTER INFO of one node; None (and ``n`` down) when it fails."""
        try:
            started = time.perf_counter()
            await client.ping()
            n.latency_ms = round((time.perf_counter() - started) * 1000, 2)
            info = await client.info("all")
            read_info(n, info, now_s)
            if cluster:
                ci = await client.execute_command("CLUSTER INFO")
                if isinstance(ci, (bytes, str)):
                    ci = dict(line.split(":", 1) for line in text(ci).splitlines() if ":" in line)
                n.cluster_state = text(ci.get("cluster_state", ""))
                n.slots_assigned, n.slots_ok = _int(ci, "cluster_slots_assigned"), _int(ci, "cluster_slots_ok")
                n.slots_pfail, n.slots_fail = _int(ci, "cluster_slots_pfail"), _int(ci, "cluster_slots_fail")
            return info
        except REDIS_FAILURES as exc:
            n.up, n.error = False, (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            return None

    # -- reading --------------------------------------------------------------------------------

    async def read(self) -> Health:
        now_s = time.time()
        started = time.perf_counter()
        if isinstance(self.redis, RedisCluster):
            health = await self._read_cluster(now_s)
        else:
            health = await self._read_single(now_s)
        remembered = await remembered_nodes(self.redis, self.keys)
        seen = {n.node for n in health.nodes}
        for node, rec in sorted(remembered.items()):
            if node not in seen and rec.get("role") == "replica":
                gone = NodeHealth(node, "replica", primary=rec.get("primary"), up=False,
                                  error="not connected to its primary")
                if isinstance(rec.get("seen_ms"), int):
                    gone.error += f" (last seen {max(0, int(now_s * 1000) - rec['seen_ms']) // 1000} s ago)"
                health.nodes.append(gone)
        health.nodes = _ordered(health.nodes)
        health.read_ms = round((time.perf_counter() - started) * 1000)
        return health

    async def _read_single(self, now_s: float) -> Health:
        mode = "sentinel" if isinstance(self.redis.connection_pool, SentinelConnectionPool) else "single"
        health = Health(mode)
        try:
            address = await self._primary_address()
        except REDIS_FAILURES as exc:
            health.nodes.append(NodeHealth("primary", "primary", up=False, error=str(exc)[:200]))
            return health
        primary = NodeHealth(address, "primary")
        info = await self._look(primary, self.redis, now_s)
        health.nodes.append(primary)
        if info is None:
            return health
        if primary.role == "replica":  # the client reached a replica (a failover under way)
            return health
        for line in listed_replicas(info):
            replica = NodeHealth(f"{text(line.get('ip'))}:{line.get('port')}", "replica", primary=address)
            await self._look(replica, self._client(replica.node), now_s)
            replica.role, replica.primary = "replica", address
            try:
                replica.lag_bytes = max(0, (primary.repl_offset or 0) - int(line.get("offset", 0)))
                replica.lag_s = float(line.get("lag", 0))
            except (TypeError, ValueError):
                pass
            if not replica.up:
                replica.link_up = text(line.get("state", "")) == "online"
            health.nodes.append(replica)
        if mode == "sentinel" and self.url:
            health.sentinel = await self._sentinel_view()
        return health

    async def _sentinel_view(self) -> dict[str, Any] | None:
        """What a Sentinel says of the primary: its flags (s_down, o_down, failover_in_progress…)."""
        from fencemq.fences.redis_servers import parse_sentinel_url

        target = parse_sentinel_url(self.url or "")
        for host, port in target.sentinels:
            c = Redis(host=host, port=port, socket_timeout=NODE_TIMEOUT_S, socket_connect_timeout=NODE_TIMEOUT_S,
                      **{k: v for k, v in target.sentinel_options.items() if k in ("username", "password", "ssl")})
            try:
                master = await c.execute_command("SENTINEL", "MASTER", target.service)
                if isinstance(master, list):
                    master = dict(zip(master[::2], master[1::2]))
                master = {text(k): text(v) for k, v in master.items()}
                return {"sentinel": f"{host}:{port}", "service": target.service, "flags": master.get("flags", ""),
                        "primary": f"{master.get('ip')}:{master.get('port')}",
                        "replicas": _int(master, "num-slaves"), "sentinels": _int(master, "num-other-sentinels") + 1}
            except REDIS_FAILURES:
                continue
            finally:
                await c.aclose()
        return None

    async def _read_cluster(self, now_s: float) -> Health:
        health = Health("cluster")
        listing: list[dict[str, Any]] = []
        for node in self.redis.get_primaries() + self.redis.get_replicas():
            try:
                listing = parse_cluster_nodes(await self._client(node.name).execute_command("CLUSTER NODES"))
                break
            except REDIS_FAILURES:
                continue
        if not listing:
            listing = [{"node": n.name, "id": n.name, "flags": "master" if n.server_type == "primary" else "slave",
                        "primary_id": "-", "connected": True} for n in self.redis.get_nodes()]
        by_id = {e["id"]: e["node"] for e in listing}
        for e in listing:
            flags = set(e["flags"].split(","))
            if "noaddr" in flags or "handshake" in flags:
                continue
            role = "replica" if "slave" in flags else "primary"
            n = NodeHealth(e["node"], role, primary=by_id.get(e["primary_id"]) if role == "replica" else None,
                           flags=",".join(sorted(flags - {"myself", "master", "slave"})))
            await self._look(n, self._client(n.node), now_s, cluster=True)
            if role == "replica":  # CLUSTER NODES is the truth of who replicates whom
                n.role, n.primary = "replica", by_id.get(e["primary_id"])
            health.nodes.append(n)
        offsets = {n.node: n.repl_offset for n in health.nodes if n.role == "primary" and n.up}
        for n in health.nodes:
            if n.role == "replica" and n.up and n.primary in offsets and n.repl_offset is not None:
                n.lag_bytes = max(0, (offsets[n.primary] or 0) - n.repl_offset)
        return health


def _ordered(nodes: list[NodeHealth]) -> list[NodeHealth]:
    """Primaries by address, each followed by its replicas; replicas of an unknown primary last."""
    primaries = sorted((n for n in nodes if n.role == "primary"), key=lambda n: n.node)
    out: list[NodeHealth] = []
    for p in primaries:
        out.append(p)
        out += sorted((n for n in nodes if n.role == "replica" and n.primary == p.node), key=lambda n: n.node)
    out += sorted((n for n in nodes if n not in out), key=lambda n: n.node)
    return out
