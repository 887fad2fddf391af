"""An MQTT connection's SUBSCRIBE and UNSUBSCRIBE: filter subscriptions with their options.

A mixin of fencemq.server.mqtt.listener.MqttConnection. A filter (wildcards or not) is a
filter subscription with a mailbox, ``$share/{group}/{filter}`` a shared group's member; the
subscription's options are written to the session before it is made (mqtt/state.py), and a
new subscriber gets the retained messages as its Retain Handling says. Each filter is the gate's
first (fencemq.server.gate): its names, the user's subscribe grant, max_subscriptions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio.abc

from fencemq.errors import BadArgument, FenceMQError, LimitExceeded, NoPermission
from fencemq.model.handles import Handle
from fencemq.protocol.mqtt.events import SubscribeRequested, UnsubscribeRequested
from fencemq.protocol.mqtt.reasons import ReasonCode
from fencemq.protocol.mqtt.session import MqttServerSession
from fencemq.server.mqtt.delivery import MqttSubscription, options_record
from fencemq.server.mqtt.messages import as_sent_for_subscribe
from fencemq.server.mqtt.state import MqttSessionState
from fencemq.server.services import Services
from fencemq.server.session import Session

log = logging.getLogger(__name__)

REFUSED = 0x80  # the SUBACK reason code "unspecified error"


class MqttSubscribing:
    __slots__ = ()  # MqttConnection holds the attributes: a compact object per connection
    services: Services
    session: Session
    mqtt: MqttServerSession
    mqtt_state: MqttSessionState
    subscriptions: dict[str, MqttSubscription]
    config: Any
    tasks: anyio.abc.TaskGroup | None

    _start_delivery: Callable[[str, MqttSubscription], None]

    async def _subscribe(self, event: SubscribeRequested) -> None:
        # publishes this worker reads from now on wait for these filters (fences/shared.py)
        async with self.services.core.shared.registry.announcing(
                [r.filter for r in event.requests if r.refusal is None]):
            await self._subscribe_each(event)

    async def _subscribe_each(self, event: SubscribeRequested) -> None:
        codes = []
        client = self.session.client_id
        assert client is not None
        for request in event.requests:
            if request.refusal is not None:
                codes.append(request.refusal)
                continue
            refusal = await self._gate_refusal(client, request.topic_filter, request.filter)
            if refusal is not None:
                codes.append(refusal)
                continue
            qos, options = request.granted_qos, request.options
            shared = request.share_group is not None
            # the options first: a session resumed after a crash right after the subscription was
            # made delivers with them, not with defaults
            await self.mqtt_state.subscribed(request.topic_filter, options_record(
                qos, options.no_local, options.retain_as_published, event.subscription_identifier))
            try:
                sub = await self.services.core.shared.subscribe(client, request.topic_filter, qos=min(qos, 1),
                                                                retained=False)
            except FenceMQError as exc:
                log.info("MQTT SUBSCRIBE to %r refused: %s", request.topic_filter[:128], exc)
                if request.topic_filter not in self.subscriptions:
                    await self.mqtt_state.unsubscribed(request.topic_filter)
                codes.append(REFUSED)
                continue
            mine = MqttSubscription(Handle.decode(sub.handle), qos, shared, options.no_local,
                                    options.retain_as_published, event.subscription_identifier)
            before = self.subscriptions.get(request.topic_filter)
            if before is not None and before.handle == mine.handle:
                # the same subscription again: new options, the same delivery task (MQTT-3.8.4-3),
                # so nothing it pulled is cut off half sent
                before.qos, before.no_local = mine.qos, mine.no_local
                before.retain_as_published, before.identifier = mine.retain_as_published, mine.identifier
                mine = before
            # Retain Handling (MQTT-3.3.1-9/10/11): 0 at every SUBSCRIBE, 1 only for a new
            # subscription, 2 never; never to a shared subscription (MQTT 5.0 §4.8.2)
            if not shared and (options.retain_handling == 0 or (options.retain_handling == 1 and sub.new_member)):
                await self._send_retained(mine.handle, request.filter)
            if mine is not before:
                self._start_delivery(request.topic_filter, mine)
            codes.append(qos)
        self.mqtt.complete_subscribe(event.packet_id, codes)

    async def _gate_refusal(self, client: str, topic_filter: str, filt: str) -> int | None:
        """The gate's answer to one filter of a SUBSCRIBE: None, or the reason code that refuses it
        (a name of the broker's, a grant that does not cover the filter, max_subscriptions)."""
        gate = self.services.gate
        try:
            gate.check_target(topic_filter)
            gate.check(self.session.user, "subscribe", filt)
            if topic_filter not in self.subscriptions:  # (each one granted is counted in Redis)
                await gate.check_subscriptions(client)
        except BadArgument:
            return ReasonCode.TOPIC_FILTER_INVALID
        except NoPermission:
            return ReasonCode.NOT_AUTHORIZED
        except LimitExceeded:
            return ReasonCode.QUOTA_EXCEEDED
        return None

    async def _send_retained(self, handle: Handle, filt: str) -> None:
        """The retained messages the filter matches (and no other: fences/retained.py), as sent
        because of a SUBSCRIBE (RETAIN 1, MQTT-3.3.1-9)."""
        shared, batch = self.services.core.shared, self.config.max_batch
        async for bodies in shared.retained.matching(filt):
            for start in range(0, len(bodies), batch):
                await shared.publishing.append(handle.queue, [as_sent_for_subscribe(b)
                                                              for b in bodies[start:start + batch]])

    async def _unsubscribe(self, event: UnsubscribeRequested) -> None:
        codes = []
        client = self.session.client_id
        assert client is not None
        for filt in event.filters:
            held = self.subscriptions.pop(filt, None)
            if held is None:
                codes.append(ReasonCode.NO_SUBSCRIPTION_EXISTED)
                continue
            held.scope.cancel()
            await self.services.core.subscriptions.unsubscribe(held.handle)
            await self.mqtt_state.unsubscribed(filt)
            codes.append(ReasonCode.SUCCESS)
        self.mqtt.complete_unsubscribe(event.packet_id, codes)

