"""An MQTT connection's end: what it held goes back, its session ends or lingers, its will.

A mixin of fencemq.server.mqtt.listener.MqttConnection. When the connection is gone, its
unacknowledged deliveries and a shared member's unsent mailbox go back at once (no
failure counted); a session with an expiry interval lingers that long (its in-flight
packet ids kept for a resume: mqtt/state.py), one without ends; the will goes now, or is scheduled
in Redis for its delay (mqtt/wills.py), or at once when a new connection with Clean Start ends
the session, unless the session was taken up again first.
"""

from __future__ import annotations

import logging

import anyio

from fencemq.errors import FenceMQError
from fencemq.fences.redis_errors import REDIS_FAILURES
from fencemq.model.handles import Handle
from fencemq.protocol.mqtt.packets import Will
from fencemq.protocol.mqtt.session import MqttServerSession
from fencemq.server.mqtt.delivery import BATCH, MqttSubscription
from fencemq.server.mqtt.state import InFlight, MqttSessionState, in_flight_record
from fencemq.server.mqtt.wills import StoredWill, Wills
from fencemq.server.services import Services
from fencemq.server.session import Session

log = logging.getLogger(__name__)

MAILBOX_DRAIN_ROUNDS = 64  # batches handed back from a departing shared member's mailbox, at most


class MqttDeparture:
    __slots__ = ()  # MqttConnection holds the attributes: a compact object per connection
    services: Services
    session: Session
    mqtt: MqttServerSession
    subscriptions: dict[str, MqttSubscription]
    in_flight: dict[int, InFlight]
    mqtt_state: MqttSessionState
    releasing: set[int]
    expiry: int
    taken_over: bool
    token: str
    will: tuple[Will, int] | None
    will_kept: bool  # the CONNECT had a will: the session's hash holds it (mqtt/wills.py)

    async def _session_over(self) -> None:
        """The connection is gone: what it held in flight goes back, the session ends or lingers."""
        client = self.session.client_id
        if not self.session.bound or client is None:
            await self.session.release()
            return
        if self.expiry == 0 and not self.taken_over:
            # Session Expiry 0 (3.1.1: clean session): the session ends with its connection, and
            # its end hands every checkout back to its queue or group
            self.session.quit = True
            await self.session.release()
            return
        if self.taken_over:
            # The connection that took the session over resumed it: what this one held is that
            # one's to hand back (mqtt/resumption.py), its records that one's to keep, its lease that one's.
            self.session.linger_ms = 0
            await self.session.release()
            return
        if self.in_flight:
            # What was in flight goes back to its queue below: the session's records say so first,
            # so a resumed session expects it from there, with its original packet id (MQTT-4.4.0-1).
            try:
                await self.mqtt_state.sending({pid: in_flight_record(f.qos, f.handle, "", f.message)
                                               for pid, f in self.in_flight.items()})
            except REDIS_FAILURES as exc:
                log.info("MQTT packet ids of %r not kept (fresh ones on resume): %s", client, exc)
        # marks the client offline (a group gives it nothing new) and, if this was its last
        # connection, starts the session's expiry in the same step
        self.session.linger_ms = self.expiry * 1000
        await self.session.release()
        # Unacknowledged deliveries go back at once (no failure counted), not after their lock:
        # a shared group gives them to another member (Mosquitto #2662), a resumed session gets
        # them again with DUP (MQTT-3.3.1-1).
        held: dict[Handle, list[str]] = {}
        for f in self.in_flight.values():
            held.setdefault(f.handle, []).append(f.tag)
        self.in_flight.clear()
        for handle, tags in held.items():
            try:
                await self.services.core.leases.nack(handle, tags, release=True)
            except FenceMQError as exc:
                log.info("MQTT deliveries of %r not released (they return after their lock): %s", client, exc)
        # What a group dispatched to the member before it was marked offline waits in its
        # mailbox, never sent: that goes back too, rather than after its lock (or the session).
        for sub in list(self.subscriptions.values()):
            if sub.shared and sub.qos:
                await self._hand_back_mailbox(sub.handle)
                await self._hand_back_unsent(sub.handle)

    async def _hand_back_mailbox(self, handle: Handle) -> None:
        leases = self.services.core.leases
        try:
            for _ in range(MAILBOX_DRAIN_ROUNDS):
                result = await leases.pull(handle, BATCH)
                tags = [d.tag for d in result.deliveries if not d.tag.startswith("q")]
                if tags:
                    await leases.nack(handle, tags, release=True)
                if len(result.deliveries) < BATCH:
                    return
        except FenceMQError as exc:
            log.info("MQTT mailbox of %s not handed back (it returns after its lock): %s", handle.queue, exc)

    async def _hand_back_unsent(self, handle: Handle) -> None:
        """What the delivery task checked out and had not yet sent when the connection went (it was
        cancelled between the two, or while the pull's reply was on its way) is neither in flight
        nor in the mailbox: the member's checkouts left now are those, and they go back too."""
        if self.taken_over:
            return  # a resumed connection holds the member's checkouts now (mqtt/resumption.py)
        leases = self.services.core.leases
        try:
            tags = [t for t in await leases.member_tags(handle) if not t.startswith("q")]
            if tags:
                await leases.nack(handle, tags, release=True)
        except (FenceMQError, *REDIS_FAILURES) as exc:
            log.info("MQTT checkouts of %s not handed back (they return after their lock): %s", handle.queue, exc)

    async def will_after_delay(self) -> None:
        """The will of a connection that ended without DISCONNECT 0x00 (mqtt/wills.py): published now,
        or scheduled in Redis for its Will Delay Interval, or the session's end if sooner; none when a
        new connection took the session up again (MQTT-3.1.3-9), at once when one started it anew."""
        client = self.session.client_id
        if client is None:
            return
        wills = Wills(self.services)
        if self.will is None:
            if self.will_kept and not self.taken_over and self.expiry > 0:
                await wills.settled(client)  # DISCONNECT 0x00 deleted it (MQTT-3.1.2-10)
            return
        will, delay = self.will
        stored = StoredWill.of(will, self.session.user)
        delay = min(delay, self.expiry)
        if self.taken_over:
            if not self.session.taken_over_afresh:
                return  # a new connection resumed the session: its will is the session's now
            delay = 0  # a new connection with Clean Start ended this session: the will goes now (MQTT-3.1.2-5)
        if delay > 0 and not will.retain:
            # stored, not held: a draining or killed worker loses nothing, publishes nothing early
            with anyio.CancelScope(shield=True):  # a worker stopping waits for these few round trips
                await wills.schedule(client, stored, delay, self.token)
            return
        if delay > 0:  # retained (a scheduled message takes no RETAIN): a timer here, as before
            await wills.settled(client)  # the timer's, not the sweeper's: never published twice
            try:
                await anyio.sleep(delay)
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):  # the worker stops: the will goes now, not never
                    await wills.publish(client, stored, 0)
                    await wills.settled(client)
                raise
            held_by = await self.services.redis.hget(self.services.keys.session(client), "conn")
            if held_by is not None and held_by.decode() != self.token:
                return  # a new connection took the session up again
        await wills.publish(client, stored, 0)
        if not self.taken_over and self.expiry > 0:
            await wills.settled(client)
