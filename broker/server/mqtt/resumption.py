"""A connecting MQTT client takes its session up: afresh (Clean Start), or resumed as it was left.

A mixin of fencemq.server.mqtt.listener.MqttConnection. The session's MQTT state is read from
Redis (mqtt/state.py), where it was written as it changed, so a session left by a worker killed
with -9 resumes exactly as one left by a graceful departure:

* what was in flight to the client comes again with its original packet identifier and DUP
  (MQTT-4.4.0-1): whatever the member still holds (leases a dead worker took) goes back to its
  queue at once, and the member's suspicion goes with it — a connection delivering proves it
  alive, so new messages flow at once;
* a QoS 2 delivery the client had received (PUBREC) gets its PUBREL again, never the message;
* the client's QoS 2 publishes stored and not yet released are known, so a retransmission is
  acknowledged, not stored again (MQTT-4.3.3-10);
* each subscription delivers again with its options.

Clean Start ends every subscription the session held first, the lmqs its RESP side took included.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.abc

from fencemq.fences import session_index
from fencemq.model.handles import Handle
from fencemq.protocol.mqtt.events import ConnectRequested, MqttEvent
from fencemq.protocol.mqtt.session import MqttServerSession
from fencemq.server.mqtt.delivery import MqttSubscription, filter_of
from fencemq.server.mqtt.state import MqttSessionState, Saved
from fencemq.server.mqtt.wills import StoredWill, Wills
from fencemq.server.services import Services
from fencemq.server.session import Session

DEFAULT_OPTIONS = (1, False, False, None)  # a subscription whose options were never written


class MqttResumption:
    __slots__ = ()  # MqttConnection holds the attributes: a compact object per connection
    services: Services
    session: Session
    mqtt: MqttServerSession
    mqtt_state: MqttSessionState
    resumed_ids: dict[str, int]
    releasing: set[int]
    completed: dict[int, int]
    nonce: str
    revoked_filters: tuple[str, ...]
    tasks: anyio.abc.TaskGroup | None

    _start_delivery: Callable[[str, MqttSubscription], None]
    _flush: Callable[[], Awaitable[None]]

    async def _take_up(self, event: ConnectRequested) -> list[MqttEvent]:
        """The bound session, afresh or resumed: the CONNACK sent, deliveries started. What the
        client sent behind its CONNECT (which waited for the accept)."""
        redis, keys, client = self.services.redis, self.services.keys, self.session.client_id
        assert client is not None
        # the will is kept with the session, so that it outlives this worker (mqtt/wills.py)
        will = StoredWill.of(event.will, self.session.user) if event.will is not None else None
        if event.clean_start:
            # a session this CONNECT created holds nothing yet: nothing to read or drop (a connect storm)
            saved = await self.mqtt_state.load(fresh=True, known_empty=not self.session.resumed,
                                               will=will.encode() if will is not None else None)
            if saved.will_sid is not None:  # the last connection's will, scheduled: due now the session ended
                await Wills(self.services).taken_up(client, saved.will, saved.will_sid, fresh=True)
            self.nonce, self.completed = saved.nonce, saved.completed
            for handle in await session_index.handles(redis, keys, client) if self.session.resumed else ():
                await self.services.core.subscriptions.unsubscribe(handle)
            if self.mqtt.closed:
                return []  # the client hung up while its session was taken up (a storm): its end leaves it
            return self.mqtt.accept(time.monotonic())
        held = await session_index.non_lite_handles(self.services.core.ctx.linked, keys, client)
        # What the member holds is read before the records: a departure still under way marks a
        # record handed back ("") before it hands the checkout back, so a record read after this
        # either shows a tag held here or says it comes back from the queue.
        leases = self.services.core.leases
        holding = {h: await leases.member_tags(h) for h in held}
        saved = await self.mqtt_state.load(fresh=False)
        if saved.will_sid is not None:  # the last connection's will, scheduled: cancelled (MQTT-3.1.3-9)
            await Wills(self.services).taken_up(client, saved.will, saved.will_sid, fresh=False)
        if will is not None or saved.will is not None:  # this CONNECT's will replaces the last one's
            await Wills(self.services).stands(client, will)
        self.nonce, self.completed = saved.nonce, saved.completed
        releasing = await self._hand_back(holding, saved)
        # (5.0) the subscriptions its user may no longer hold, that the gate dropped, are told here
        told = tuple(("subscription-revoked", filt) for filt in self.revoked_filters)
        if self.mqtt.closed:
            return []  # the client hung up while its session was taken up (a storm): its end leaves it
        pipelined = self.mqtt.accept(
            time.monotonic(), session_present=self.session.resumed or bool(held or saved.in_flight or releasing),
            inbound_releases=frozenset(saved.recorded), user_properties=told)
        self.mqtt.outbound_flows.reserve(list(self.resumed_ids.values()))
        for packet_id in sorted(releasing):  # received before the connection dropped: complete the handshake
            self.mqtt.resend_release(packet_id)
            self.releasing.add(packet_id)
        if releasing:
            await self._flush()
        for handle in held:  # its subscriptions deliver again, with their options
            shared = (handle.queue.owner or "").startswith("$share/")
            filt = filter_of(handle)
            options: Any = json.loads(saved.options[filt]) if filt in saved.options else DEFAULT_OPTIONS
            qos, no_local, rap, ident = options
            self._start_delivery(filt, MqttSubscription(handle, qos, shared, no_local, rap, ident))
        return pipelined

    async def _hand_back(self, holding: dict[Handle, list[str]], saved: Saved) -> set[int]:
        """What the session had in flight: to be sent again with its packet id once it is back in
        its queue (all the member holds goes back now, its suspicion cleared). The QoS 2 deliveries
        the client had received: their packet ids, to release."""
        leases = self.services.core.leases
        releasing = set(saved.releasing)
        settled: list[int] = []
        for packet_id, f in saved.in_flight.items():
            if f.tag == "" or f.tag in holding.get(f.handle, ()):
                self.resumed_ids[f"{f.handle.encode()}|{f.message}"] = packet_id
            elif f.qos == 2:  # settled at its PUBREC by a worker that died before saying so
                releasing.add(packet_id)
                await self.mqtt_state.received(packet_id)
            else:  # settled at its PUBACK by a worker that died before forgetting it
                settled.append(packet_id)
        await self.mqtt_state.settled(settled)
        for handle, tags in holding.items():
            await leases.alive(handle, tags)
        return releasing
