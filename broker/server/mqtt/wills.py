"""An MQTT session's will, kept in Redis: scheduled when it has a delay, published by the sweeper
when its worker died.

The will a CONNECT carries is written into the session's hash (``mqtt-will``, beside the rest of
the session's MQTT state: mqtt/state.py) before the CONNACK, so it outlives the worker that
holds the connection. When the connection ends without DISCONNECT 0x00 (the network, a keep
alive missed, the worker draining), the will goes:

* at once when it has no delay (or the session ends with its connection, or a new connection
  starts it anew: MQTT-3.1.2-5);
* otherwise as a scheduled message (``PUB … DELAY``, fences/schedule.py: the one path of every
  door), due after min(Will Delay Interval, Session Expiry Interval) (MQTT 5 §3.1.3.2.2), its
  schedule id written in the session's hash (``mqtt-will-sid``). A connection that takes the
  session up again before then cancels it (``UNPUB``, MQTT-3.1.3-9); one that starts it anew
  (Clean Start 1) ends the session, so a will it cancelled goes at once. A draining worker
  therefore publishes nothing early: the will waits in Redis, not in the worker.

A worker killed with -9 says nothing: its sessions' leases lapse and another worker's sweeper
ends them (fences/sessions.py). A session it ends that still holds a will neither published nor
scheduled (``mqtt-will`` without ``mqtt-will-sid``) has its will published then: the session
ends, so the will is due (MQTT 5 §3.1.3.2.2: the delay or the session's end, whichever first).

The gate: a will is a publish by the session's user. It is checked at CONNECT (refused: 0x87)
and against the user's record of now when it is published — at once, or, for a delayed one, when
it is scheduled (the moment the connection ends), as a RESP ``PUB … DELAY`` is checked when it is
sent and not again when the sweeper releases it. A grant revoked during the delay does not stop
it; ``fencemq scheduled cancel`` does.

A retained will with a delay keeps the timer in the worker's memory (a scheduled message takes no
RETAIN: docs/protocol.md): it is published when its worker stops, and lost with a killed worker
unless the sweeper finds it first.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING


from fencemq.errors import FenceMQError
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.model.messages import MAX_TTL_MS
from fencemq.ops.users import User
from fencemq.protocol.mqtt.packets import Will
from fencemq.protocol.mqtt.properties import Properties
from fencemq.server import metrics
from fencemq.server.mqtt.messages import headers_of
from fencemq.server.mqtt.state import WILL, WILL_SID

if TYPE_CHECKING:
    from fencemq.server.services import Services

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class StoredWill:
    """A will as its session keeps it: enough to publish it without its connection."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    headers: dict[str, str] | None  # what its properties say, but the expiry
    expiry_s: int | None  # its Message Expiry Interval: counted from when it is published
    delay_s: int
    user: str | None  # the user it publishes as (None: a broker without users)
    superuser: bool = False

    @classmethod
    def of(cls, will: Will, user: User | None) -> StoredWill:
        props: Properties = will.properties
        expiry = props.message_expiry_interval
        headers = headers_of(will.qos, will.retain, replace(props, message_expiry_interval=None), 0)
        return cls(will.topic, will.payload, will.qos, will.retain, headers, expiry,
                   props.will_delay_interval or 0, user.name if user else None, bool(user and user.superuser))

    def encode(self) -> str:
        return json.dumps([self.topic, base64.b64encode(self.payload).decode(), self.qos, int(self.retain),
                           self.headers, self.expiry_s, self.delay_s, self.user, int(self.superuser)])

    @classmethod
    def decode(cls, raw: bytes | str) -> StoredWill:
        topic, payload, qos, retain, headers, expiry, delay, user, superuser = json.loads(raw)
        return cls(topic, base64.b64decode(payload), qos, bool(retain), headers, expiry, delay, user, bool(superuser))

    def publisher(self) -> User | None:
        return None if self.user is None else User(self.user, superuser=self.superuser)


class Wills:
    """The wills of MQTT sessions, in their session hashes."""

    def __init__(self, services: Services) -> None:
        self.services = services

    def _key(self, client: str) -> str:
        return self.services.keys.session(client)

    async def stands(self, client: str, will: StoredWill | None) -> None:
        """A resumed session's will is this CONNECT's (or none) from now: written before the CONNACK
        (a Clean Start writes it with the session's fresh state: mqtt/state.py)."""
        if will is None:
            await self.services.redis.hdel(self._key(client), WILL)
        else:
            await self.services.redis.hset(self._key(client), WILL, will.encode())

    async def settled(self, client: str) -> None:
        """The will was published, deleted (DISCONNECT 0x00) or the session ended: nothing stands."""
        await self.services.redis.hdel(self._key(client), WILL, WILL_SID)

    async def pending(self, client: str) -> tuple[StoredWill | None, tuple[str, str] | None]:
        """The session's will and, when scheduled, (topic, schedule id)."""
        raw, sid = await self.services.redis.hmget(self._key(client), [WILL, WILL_SID])
        will = StoredWill.decode(raw) if raw is not None else None
        return will, tuple(json.loads(sid)) if sid is not None else None  # type: ignore[return-value]

    async def taken_up(self, client: str, will: bytes | None, scheduled: bytes, *, fresh: bool) -> None:
        """A new connection takes up a session whose last connection scheduled its will (``scheduled``,
        read with the session's state: mqtt/state.py): cancelled (MQTT-3.1.3-9); with Clean Start
        (``fresh``) the session ended, so the will goes now instead (MQTT-3.1.2-5)."""
        topic, sid = json.loads(scheduled)
        if await self.cancel(topic, sid) and fresh and will is not None:
            await self.publish(client, StoredWill.decode(will), 0)
        if not fresh:  # a Clean Start dropped it already
            await self.services.redis.hdel(self._key(client), WILL_SID)

    async def cancel(self, topic: str, sid: str) -> int:
        ref = self.services.core.ctx.queue(topic, None)
        try:
            cancelled = await self.services.core.scheduling.cancel(ref, [sid])
        except (FenceMQError, *REDIS_FAILURES) as exc:
            log.info("MQTT will %s on %r not cancelled: %s", sid, topic[:128], exc)
            return 0
        metrics.SCHEDULED_CANCELLED.inc(cancelled)
        return cancelled

    async def publish(self, client: str, will: StoredWill, delay_s: int) -> str | None:
        """Publish the will as its user of now may (at once, or scheduled ``delay_s`` ahead): the
        message id or schedule id, None when not published."""
        services = self.services
        try:
            if not await services.gate.allows_now(will.publisher(), "publish", will.topic):
                # allowed at CONNECT; the user's grants of now decide whether it goes out
                log.info("MQTT will of %r not published: its user may no longer publish on %r", client,
                         will.topic[:128])
                return None
            delay_ms = min(delay_s * 1000, services.config.max_delay_ms) if delay_s > 0 else None
            ttl_ms = None if will.expiry_s is None else min(max(will.expiry_s * 1000, 1), MAX_TTL_MS)
            ids = await services.core.shared.publish(
                will.topic, [will.payload], qos=min(will.qos, 1), headers=will.headers, retain=will.retain,
                producer=client, delay_ms=delay_ms, ttl_ms=ttl_ms)
        except (FenceMQError, *REDIS_FAILURES) as exc:
            log.info("MQTT will of %r not published: %s", client, exc)
            return None
        if delay_ms is not None:
            metrics.SCHEDULED.inc()
        return ids[0] if ids else None

    async def schedule(self, client: str, will: StoredWill, delay_s: int, token: str) -> bool:
        """The will of connection ``token``, gone, due in ``delay_s``: scheduled and its schedule id
        written in the session. False when it could not be. A connection that took the session up
        meanwhile may have looked before the id was written: the id is cancelled here then."""
        sid = await self.publish(client, will, delay_s)
        if sid is None:
            return False
        redis, key = self.services.redis, self._key(client)
        record = json.dumps([will.topic, sid])
        await redis.hset(key, WILL_SID, record)
        held_by = await redis.hget(key, "conn")
        if held_by is not None and held_by.decode() != token:
            await self.cancel(will.topic, sid)
            if await redis.hget(key, WILL_SID) in (record, record.encode()):
                await redis.hdel(key, WILL_SID)
        return True

    async def left_behind(self, client: str) -> StoredWill | None:
        """Read before the sweeper ends a session: a will neither published nor scheduled (its
        connection's worker died), to publish once the session is over."""
        try:
            will, scheduled = await self.pending(client)
        except (*REDIS_FAILURES, ValueError) as exc:
            log.info("MQTT will of %r unreadable: %s", client, exc)
            return None
        return will if scheduled is None else None
