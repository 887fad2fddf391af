"""An MQTT session's own state, kept in Redis at the moment it changes.

What MQTT asks a server to remember across connections, beyond FenceMQ's subscriptions and
checkouts, lives in fields of the FenceMQ session's hash (``keys.session(client)``, gone with the
session), each written with — or before — the step that makes it true, so any worker resumes the
session after a ``kill -9`` exactly as after a graceful departure:

* ``mqtt-sub:<filter>``: a subscription's options (granted QoS, No Local, Retain As Published,
  identifier), written before the SUBACK;
* ``mqtt-out:<packet id>``: a QoS 1/2 delivery in flight, ``[qos, handle, tag, message id]``,
  written before its PUBLISH goes out; ``rel`` once the client's PUBREC settled it (written
  before the PUBREL goes out); removed after the PUBACK or PUBCOMP settled it;
* ``mqtt-rec:<packet id>``: the client's QoS 2 publish stored and PUBRECed, awaiting its PUBREL
  (written before the PUBREC goes out, removed before the PUBCOMP does);
* ``mqtt-gen:<packet id>``: how many of the client's QoS 2 publishes with that identifier were
  completed, and ``mqtt-nonce`` the session's own random id: a QoS 2 publish is stored with the
  dedup id ``mqtt:<nonce>:<packet id>:<gen>``, so one stored just before a crash, before it was
  recorded, is not stored again when the client sends it again — and a new publish that reuses
  the identifier after PUBCOMP is a new message;
* ``mqtt-will`` and ``mqtt-will-sid``: the will, and the schedule id of a delayed one (mqtt/wills.py).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from fencemq.model.keys import Keyspace
from fencemq.model.handles import Handle

SUB = "mqtt-sub:"
OUT = "mqtt-out:"
REC = "mqtt-rec:"
GEN = "mqtt-gen:"
NONCE = "mqtt-nonce"
WILL = "mqtt-will"  # the CONNECT's will (mqtt/wills.py)
WILL_SID = "mqtt-will-sid"  # the topic and schedule id of the will scheduled at the connection's end
RELEASING = b"rel"
# what sessions of earlier versions kept at a graceful departure only: dropped when found
LEGACY = ("mqtt-inflight", "mqtt-releasing", "mqtt-recorded")


@dataclass(slots=True)
class InFlight:
    """A delivery the session had sent and the client had not settled."""

    qos: int
    handle: Handle
    tag: str  # "" once handed back to its queue (a departure): it comes again from there
    message: str


@dataclass(slots=True)
class Saved:
    """What a connecting client's session holds in Redis."""

    nonce: str
    options: dict[str, bytes] = field(default_factory=dict)  # filter -> subscription options
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    releasing: set[int] = field(default_factory=set)  # QoS 2 deliveries received: PUBREL again
    recorded: set[int] = field(default_factory=set)  # the client's QoS 2 publishes awaiting PUBREL
    completed: dict[int, int] = field(default_factory=dict)  # packet id -> QoS 2 publishes completed
    will: bytes | None = None  # the will the session held (mqtt/wills.py), read before a Clean Start dropped it
    will_sid: bytes | None = None  # and the schedule id of that will, when it was scheduled


def in_flight_record(qos: int, handle: Handle, tag: str, message: str) -> str:
    return json.dumps([qos, handle.encode(), tag, message])


class MqttSessionState:
    """The MQTT fields of one client's session hash: read once at CONNECT, written as they change."""

    def __init__(self, redis: Any, keys: Keyspace, client: str) -> None:
        self.redis = redis
        self.key = keys.session(client)

    async def load(self, *, fresh: bool, known_empty: bool = False, will: str | None = None) -> Saved:
        """The session's MQTT state; ``fresh`` (Clean Start): dropped, under a new nonce, with
        ``will`` (a will's record: mqtt/wills.py) in the same step; ``known_empty``: the session was
        created just now, so there is nothing to read."""
        fields = {} if known_empty else await self.redis.hgetall(self.key)
        mine = [k for k in fields if k.startswith(b"mqtt-")]
        if fresh:
            saved = Saved(secrets.token_hex(8), will=fields.get(WILL.encode()), will_sid=fields.get(WILL_SID.encode()))
            start = {NONCE: saved.nonce, **({WILL: will} if will is not None else {})}
            if not mine:  # nothing to drop: one command, no transaction
                await self.redis.hset(self.key, mapping=start)
                return saved
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hdel(self.key, *mine)
                pipe.hset(self.key, mapping=start)
                await pipe.execute()
            return saved
        nonce = fields.get(NONCE.encode())
        if nonce is None:
            nonce = secrets.token_hex(8).encode()
            if not await self.redis.hsetnx(self.key, NONCE, nonce):
                nonce = await self.redis.hget(self.key, NONCE)
        saved = Saved(nonce.decode())
        legacy = [k for k in mine if k.decode() in LEGACY]
        if legacy:
            await self.redis.hdel(self.key, *legacy)
        for raw, value in fields.items():
            name = raw.decode("utf-8", "surrogateescape")
            if name.startswith(SUB):
                saved.options[name[len(SUB):]] = value
            elif name.startswith(OUT):
                packet_id = int(name[len(OUT):])
                if value == RELEASING:
                    saved.releasing.add(packet_id)
                else:
                    qos, handle, tag, message = json.loads(value)
                    saved.in_flight[packet_id] = InFlight(qos, Handle.decode(handle), tag, message)
            elif name.startswith(REC):
                saved.recorded.add(int(name[len(REC):]))
            elif name.startswith(GEN):
                saved.completed[int(name[len(GEN):])] = int(value)
            elif name == WILL:
                saved.will = value
            elif name == WILL_SID:
                saved.will_sid = value
        return saved

    # -- subscriptions ----------------------------------------------------------------------------

    async def subscribed(self, filt: str, options: str) -> None:
        await self.redis.hset(self.key, SUB + filt, options)

    async def unsubscribed(self, filt: str) -> None:
        await self.redis.hdel(self.key, SUB + filt)

    # -- deliveries (server to client) ------------------------------------------------------------

    async def sending(self, records: dict[int, str]) -> None:
        """Deliveries about to go out: their packet ids, before their PUBLISHes leave."""
        await self.redis.hset(self.key, mapping={OUT + str(p): r for p, r in records.items()})

    async def received(self, packet_id: int) -> None:
        """A QoS 2 delivery the client PUBRECed, settled in FenceMQ: PUBREL (again) is what remains."""
        await self.redis.hset(self.key, OUT + str(packet_id), RELEASING)

    async def settled(self, packet_ids: list[int]) -> None:
        """Deliveries over (PUBACK, PUBCOMP, a refusal, or not there any more)."""
        if packet_ids:
            await self.redis.hdel(self.key, *[OUT + str(p) for p in packet_ids])

    # -- publishes (client to server) -------------------------------------------------------------

    async def recorded(self, packet_ids: list[int]) -> None:
        """The client's QoS 2 publishes stored: PUBREC goes out after this."""
        if packet_ids:
            await self.redis.hset(self.key, mapping={REC + str(p): 1 for p in packet_ids})

    async def completed(self, packet_id: int) -> int:
        """The client released its QoS 2 publish (PUBREL): forgotten, and its identifier's count of
        completed publishes moved on, in one step. The new count."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self.key, REC + str(packet_id))
            pipe.hincrby(self.key, GEN + str(packet_id), 1)
            _, count = await pipe.execute()
        return int(count)


def dedup_id(nonce: str, packet_id: int, completed: int) -> str:
    """The dedup id of a client's QoS 2 publish: the same for its retransmissions, another for the
    next publish that reuses the identifier."""
    return f"mqtt:{nonce}:{packet_id}:{completed}"
