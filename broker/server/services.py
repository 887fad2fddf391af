"""What one worker shares with all its connections: Redis, the fences, pub/sub, the gate.

The worker builds these once its Redis answers and hands them to every
connection, session and verb; nothing here knows a worker or a connection,
so the worker, the connection and the verbs import this module and never
each other the wrong way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis, RedisCluster

from fencemq.config import Config
from fencemq.fences.core import Core
from fencemq.fences.sessions import RedisClock, Sessions
from fencemq.model.keys import Keyspace
from fencemq.ops.totals import SharedReading
from fencemq.ops.users import UserStore
from fencemq.server.gate import Gate
from fencemq.server.handles import HandleSigner
from fencemq.server.roster import Roster
from fencemq.server.wakeups import Wakeups


@dataclass(frozen=True, slots=True)
class Services:
    config: Config
    worker_id: str
    redis: Redis | RedisCluster
    core: Core
    keys: Keyspace
    clock: RedisClock
    sessions: Sessions
    wakeups: Wakeups
    users: UserStore
    gate: Gate  # identity, grants, limits and budgets: what every door asks (server/gate.py)
    totals: SharedReading  # the broker's totals, read at most once per totals_read_ms (ops/totals.py)
    roster: Roster = field(default_factory=Roster)
    handles: HandleSigner = field(default_factory=HandleSigner)  # its secret is loaded when the worker starts

    @classmethod
    def over(cls, redis: Redis | RedisCluster, config: Config, worker_id: str) -> Services:
        """The services of a worker on this Redis connection (nothing is started yet)."""
        core = Core(redis, config)
        users = UserStore(redis, core.keys.users)
        return cls(
            config=config,
            worker_id=worker_id,
            redis=redis,
            core=core,
            keys=core.keys,
            clock=core.clock,
            sessions=core.sessions,
            wakeups=Wakeups(redis, f"{config.prefix}:worker:{worker_id}"),
            users=users,
            gate=Gate(config, users, keys=core.keys, core=core),
            totals=SharedReading(redis, core.keys, config.totals_read_ms),
        )
