"""What an MQTT connection sends: a task per subscription pulls from its mailbox and sends.

A mixin of fencemq.server.mqtt.listener.MqttConnection. Each subscription's task pulls
in batches as the client's Receive Maximum allows (its send quota) and waits on the
queue's wake channel between; each delivery is shaped by the subscription's options
(No Local, Retain As Published, the identifier) and its message's expiry, and what is
not sent as QoS 1/2 (QoS 0, expired, the client's own under No Local) is settled at once.

The gate's output budget: the subscriptions of one connection take turns, so the worker
holds one pulled batch for a client at a time, and a write the client has not taken
within output_timeout_ms closes the connection (as RESP's).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from fencemq.errors import NotFound, Stale
from fencemq.fences.redis_errors import REDIS_FAILURES, redis_failure
from fencemq.model.handles import Handle
from fencemq.protocol.mqtt.events import DeliveryAcknowledged
from fencemq.protocol.mqtt.properties import NO_PROPERTIES
from fencemq.protocol.mqtt.session import MqttServerSession
from fencemq.server.mqtt.state import InFlight, MqttSessionState, in_flight_record
from fencemq.server.mqtt.messages import QOS, RETAIN, RETAINED, properties_of, remaining_expiry
from fencemq.server.services import Services
from fencemq.server.session import Session

log = logging.getLogger(__name__)

BATCH = 64  # deliveries fetched per pull, at most (and at most the client's send quota)
# A subscription with nothing to send looks again after IDLE_LOOK_S (the wake-ups tell it of anything
# new), then twice as long after each look that found nothing, up to IDLE_LOOK_MAX_S: 20,000 idle
# devices cost a worker a few hundred looks a second, not 20,000.
IDLE_LOOK_S = 1.0
IDLE_LOOK_MAX_S = 30.0
REDIS_RETRY_S = 0.5  # after Redis failed a pull (a failover): the pause before the next look


@dataclass(slots=True)
class MqttSubscription:
    """One filter of the client: its FenceMQ subscription and the MQTT options that shape delivery."""

    handle: Handle
    qos: int
    shared: bool
    no_local: bool = False
    retain_as_published: bool = False
    identifier: int | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    def saved(self) -> str:
        return options_record(self.qos, self.no_local, self.retain_as_published, self.identifier)


def options_record(qos: int, no_local: bool, retain_as_published: bool, identifier: int | None) -> str:
    """A subscription's options as the session keeps them (mqtt/state.py)."""
    return json.dumps([qos, no_local, retain_as_published, identifier])


def filter_of(handle: Handle) -> str:
    """The filter a client subscribed with (``$share/g/f`` for a shared group's member), from its handle."""
    owner = handle.queue.owner or ""
    return f"{owner}/{handle.queue.topic}" if owner.startswith("$share/") else handle.queue.topic


class MqttDelivery:
    __slots__ = ()  # MqttConnection holds the attributes: a compact object per connection
    services: Services
    session: Session
    mqtt: MqttServerSession
    stream: anyio.abc.ByteStream
    subscriptions: dict[str, MqttSubscription]
    in_flight: dict[int, InFlight]
    releasing: set[int]
    mqtt_state: MqttSessionState
    resumed_ids: dict[str, int]
    tasks: anyio.abc.TaskGroup | None
    write_lock: Any  # (mqtt/wire.py QuietLock)
    output_turn: Any
    quota_freed: Any  # an anyio.Event while a delivery waits for quota
    protocol_level: int
    draining: bool
    token: str

    def cut(self) -> None: ...

    async def _write(self, data: bytes) -> None:
        """Send, within output_timeout_ms: a client that does not take it by then is closed."""
        with anyio.move_on_after(self.services.gate.output_timeout_s) as waited:
            try:
                await self.stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the reader sees the connection go; what is in flight goes back then
        if waited.cancelled_caught:
            log.info("closing MQTT connection %s: it has not read what it was sent for %d ms", self.token,
                     self.services.config.output_timeout_ms)
            self.cut()

    def _start_delivery(self, filt: str, sub: MqttSubscription) -> None:
        old = self.subscriptions.pop(filt, None)
        if old is not None:
            old.scope.cancel()
        self.subscriptions[filt] = sub
        assert self.tasks is not None
        self.tasks.start_soon(self._deliver, sub)

    async def _deliver(self, sub: MqttSubscription) -> None:
        leases, wakeups = self.services.core.leases, self.services.wakeups
        handle = sub.handle
        idle_s = IDLE_LOOK_S
        with sub.scope:
            async with wakeups.watching(self.services.keys.queue(handle.queue).wake) as waiter:
                while not self.mqtt.closed and not self.draining:
                    quota = self.mqtt.send_quota if sub.qos else BATCH
                    if quota <= 0:
                        self.quota_freed = anyio.Event()
                        await self.quota_freed.wait()
                        continue
                    paused = False
                    async with self.output_turn:  # one pulled batch held for the client at a time
                        try:
                            # gathered with the other subscriptions' looks (a storm resumes thousands at once)
                            result = await leases.pull_gathered(handle, min(quota, BATCH))
                            if result.deliveries:
                                idle_s = IDLE_LOOK_S
                                await self._send(sub, result.deliveries)
                                continue
                            if result.status == "suspected" and not any(
                                    f.handle == handle for f in self.in_flight.values()):
                                # suspected for leases this connection never held (a worker killed under
                                # an earlier one): a connection delivering proves the member alive
                                await leases.alive(handle)
                                continue
                        except NotFound:
                            log.info("MQTT subscription %s of %r ended", handle.queue, self.session.client_id)
                            return  # the subscription is gone (its queue dropped): nothing more to send
                        except Stale:
                            # the worker too far behind (a connect storm) for the fence to run within
                            # its lease intent, twice: nothing was leased. Not a failure of the
                            # connection: the subscription waits as after a look that found nothing
                            # (a wake-up, or its backoff: 20,000 of them do not retry together)
                            pass
                        except REDIS_FAILURES as exc:
                            # Redis failing over: the subscription stays and looks again shortly; what was
                            # checked out and not sent comes back when its lease runs out
                            log.info("MQTT delivery to %r paused: %s", self.session.client_id,
                                     redis_failure(exc, "an MQTT delivery").message[:200])
                            paused = True
                    if paused:
                        await anyio.sleep(REDIS_RETRY_S)
                        continue
                    with anyio.move_on_after(idle_s) as idle:
                        await waiter.wait()
                    idle_s = min(2 * idle_s, IDLE_LOOK_MAX_S) if idle.cancelled_caught else IDLE_LOOK_S

    async def _send(self, sub: MqttSubscription, deliveries: list[Any]) -> None:
        settle_now = []
        me = self.session.client_id
        now_ms = await self.services.clock.now_ms()
        records: dict[int, str] = {}
        async with self.write_lock:
            for d in deliveries:
                headers = d.headers or {}
                expiry = remaining_expiry(headers, now_ms)
                if (expiry is not None and expiry <= 0) or (sub.no_local and not sub.shared and d.producer == me):
                    # expired (MQTT-3.3.2-5), or the client's own publish to a No Local
                    # subscription (MQTT-3.8.3-3): done with, never sent
                    if not d.tag.startswith("q"):
                        settle_now.append(d.tag)
                    continue
                granted = min(sub.qos, int(headers.get(QOS, d.qos)))
                retain = headers.get(RETAINED) == "subscribe" or (sub.retain_as_published and RETAIN in headers)
                props = properties_of(headers, expiry, sub.identifier) if self.protocol_level == 5 else NO_PROPERTIES
                packet_id = None
                if self.resumed_ids and granted:
                    packet_id = self.resumed_ids.pop(f"{sub.handle.encode()}|{d.id}", None)
                    if packet_id in self.mqtt.outbound_flows.inflight:
                        packet_id = None  # taken by a delivery sent since: a fresh one
                sent = self.mqtt.deliver(d.topic, d.payload, granted, retain, props,
                                         dup=d.deliveries > 1 and granted > 0, packet_id=packet_id)
                if sent.packet_id is not None:
                    self.in_flight[sent.packet_id] = InFlight(granted, sub.handle, d.tag, d.id)
                    records[sent.packet_id] = in_flight_record(granted, sub.handle, d.tag, d.id)
                elif not d.tag.startswith("q"):
                    settle_now.append(d.tag)  # QoS 0 to this client, or too big for it: done
            if records:
                # in Redis before the PUBLISHes leave: a session resumed after a crash sends them
                # again with these packet ids (MQTT-4.4.0-1)
                await self.mqtt_state.sending(records)
            data = self.mqtt.outbound()
            if data:
                await self._write(data)
        if settle_now:
            await self.services.core.leases.ack(sub.handle, settle_now)

    # -- the client's acknowledgements ----------------------------------------------------------

    async def _acknowledged(self, events: list[DeliveryAcknowledged]) -> None:
        """PUBACKs and PUBCOMPs (and refusing PUBRECs) of one read: settled in FenceMQ, then
        forgotten by the session (a crash between the two leaves a record the resume drops)."""
        if not events:
            return
        settled: dict[Handle, list[str]] = {}
        refused: dict[Handle, list[str]] = {}
        over: list[int] = []
        for event in events:
            over.append(event.packet_id)
            if event.packet_id in self.releasing:  # PUBCOMP of a delivery settled at its PUBREC
                self.releasing.discard(event.packet_id)
                continue
            held = self.in_flight.pop(event.packet_id, None)
            if held is not None:
                # refused by the client (>= 0x80): dropped, never redispatched (MQTT-234)
                (refused if event.reason_code >= 0x80 else settled).setdefault(held.handle, []).append(held.tag)
        if events:
            self.quota_freed.set()
        leases = self.services.core.leases
        for handle, tags in settled.items():
            await leases.ack(handle, tags)
        for handle, tags in refused.items():
            await leases.nack(handle, tags, discard=True)
        await self.mqtt_state.settled(over)

    async def _received(self, packet_id: int) -> None:
        """PUBREC: the client has the QoS 2 message. It is settled in FenceMQ now, so it is never
        sent again, and the session says so before the PUBREL goes out; what remains (PUBREL,
        PUBCOMP) is the handshake's, which a resumed session completes."""
        held = self.in_flight.pop(packet_id, None)
        self.releasing.add(packet_id)
        if held is not None:
            try:
                await self.services.core.leases.ack(held.handle, [held.tag])
            except NotFound:
                pass  # the subscription is gone, and what it held with it
        await self.mqtt_state.received(packet_id)
        self.mqtt.release_delivery(packet_id)
