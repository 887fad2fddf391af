"""MQTT clients on a worker: the anyio shell around the sans-I/O session (protocol/mqtt/session.py).

`fencemq serve --mqtt-port N` listens for MQTT 3.1.1 and 5.0 over TCP beside RESP. Each
connection is one `MqttServerSession` fed by the socket; its events become FenceMQ's own
operations, so MQTT clients get the same guarantees as RESP ones and share one topic space:

* CONNECT binds a FenceMQ session named by the client id (taking it over from an older
  connection, which gets DISCONNECT 0x8E); `Clean Start` ends what the old session held.
* SUBSCRIBE is a filter subscription with a mailbox (`$share/{group}/{filter}` a shared group,
  any other filter, wildcards or not, a private one): the same queues RESP's `SUB` makes, so a
  RESP `PUB` reaches MQTT subscribers and an MQTT PUBLISH reaches RESP ones.
* PUBLISH is a publish through the filter path (QoS 2 is stored as QoS 1: at least once through
  Redis, exactly once on the wire by the session's packet-id rules); RETAIN keeps the last one.
* A QoS 1/2 delivery is a checkout: PUBACK/PUBCOMP acknowledges it, a reason code >= 0x80
  discards it (no redispatch, MQTT-234); one never acknowledged comes back after its lease.
* The client's Session Expiry Interval is the FenceMQ session's lease once the connection is gone
  (0: the session ends with it); what the connection had in flight goes back at once.
* The will is published when the connection ends without DISCONNECT 0x00, after its Will Delay
  Interval or at the session's end if sooner, unless a new connection takes the session up first.
* Message properties travel as `mqtt-*` headers (server/mqtt/messages.py); subscription options
  (identifier, No Local, Retain As Published, Retain Handling) shape each delivery.

`--mqtt-ws-port` serves the same over WebSocket (server/mqtt/websocket.py).

Only `accept`ed sessions touch Redis; each subscription has a task that pulls from its mailbox
in batches as the client's Receive Maximum allows and waits on the queue's wake channel
(server/mqtt/delivery.py); the connection's end — in-flight handed back, the session ended or
lingering, the will — is server/mqtt/departure.py's.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import anyio
import anyio.abc

from fencemq.errors import FenceMQError, NoPermission
from fencemq.fences import session_index
from fencemq.fences.redis_errors import REDIS_FAILURES, redis_failure
from fencemq.model.keys import Handle
from fencemq.model.topics import matches
from fencemq.protocol.mqtt.events import (
    SESSION_NEVER_EXPIRES, ConnectionClosed, ConnectRequested, DeliveryAcknowledged, DeliveryReceived,
    MessagePublished, MqttEvent, MqttServerLimits, PublishReleased, SubscribeRequested, UnsubscribeRequested,
)
from fencemq.protocol.mqtt.packets import Will
from fencemq.protocol.mqtt.reasons import ReasonCode
from fencemq.protocol.mqtt.session import MqttServerSession
from fencemq.server.mqtt.messages import (
    as_sent_for_subscribe, headers_of,
)
from fencemq.server.mqtt.delivery import MqttDelivery, MqttSubscription
from fencemq.server.mqtt.departure import INFLIGHT_FIELD, RECORDED_FIELD, RELEASING_FIELD, MqttDeparture
from fencemq.server.session import Session

log = logging.getLogger(__name__)

READ_SIZE = 65536
REFUSED = 0x80  # the SUBACK reason code "unspecified error"
SUB_FIELD = "mqtt-sub:"  # session hash field per subscription: the options a resumed session needs


class MqttConnection(MqttDelivery, MqttDeparture):
    def __init__(self, worker: Any, stream: anyio.abc.ByteStream, token: str) -> None:
        self.worker, self.services, self.verbs = worker, worker.services, worker.verbs
        self.config = worker.config
        self.stream = stream
        limits = MqttServerLimits(maximum_session_expiry_interval=self.config.mqtt_max_session_expiry_s)
        self.mqtt = MqttServerSession(limits, now=time.monotonic())
        self.session = Session(self.services, token, watch_for_hangup=self._no_hangup_watch,
                               end_connection=self._taken_over)
        self.token = token
        self.write_lock = anyio.Lock()
        self.quota_freed = anyio.Event()
        self.subscriptions: dict[str, MqttSubscription] = {}  # by topic filter as the client sent it
        self.in_flight: dict[int, tuple[Handle, str, str]] = {}  # packet id -> handle, tag, message id
        self.resumed_ids: dict[str, int] = {}  # "<handle>|<message id>" -> the packet id it was sent with
        # QoS 2 deliveries the client received (PUBREC): settled in FenceMQ, awaiting PUBCOMP
        self.releasing: set[int] = set()
        self.tasks: anyio.abc.TaskGroup | None = None
        self.protocol_level = 0
        self.expiry = 0  # seconds the session outlives the connection (the FenceMQ session's lease then)
        self.taken_over = False
        self.draining = False  # the worker shuts down: nothing new is sent
        self.reading = anyio.Lock()  # held while what one read brought is handled
        self.left = False  # DISCONNECT sent by the worker: nothing more is read
        self.will: tuple[Will, int] | None = None  # the will to publish after the connection, and its delay

    async def _no_hangup_watch(self, scope: anyio.CancelScope) -> None:
        await anyio.sleep_forever()  # MQTT verbs never wait inside the session: the reader runs all along

    def _taken_over(self) -> None:
        self._handle_later(self.mqtt.take_over())

    # The worker holds its MQTT connections beside its RESP ones (Worker.connections): it keeps
    # their sessions' leases alive, cuts one whose session is gone, and drains them on shutdown.

    def drain(self, notice: dict[str, Any] | None = None, move_s: float = 0.0) -> None:
        """The worker stops: no new deliveries; what is in flight gets up to half of drain_timeout_ms
        to be acknowledged (so a client that reconnects is not sent it again); then DISCONNECT 0x8B
        Server shutting down (5.0, with the Server Reference when configured) and close. The session
        lingers for its expiry."""
        if self.tasks is None or self.mqtt.closed:
            return  # over already, or letting go of its session right now
        self.draining = True
        self.quota_freed.set()  # a delivery waiting for quota looks again, and stops
        self.tasks.start_soon(self._leave, self.config.drain_timeout_ms / 2000)

    async def _leave(self, bound_s: float) -> None:
        with anyio.move_on_after(bound_s):
            while self.in_flight or self.releasing:
                await anyio.sleep(0.02)
        # Between two reads: a PUBLISH is never stored with its PUBACK cut off by the DISCONNECT
        # (the client would send it again elsewhere, and it would be stored twice)
        async with self.reading:
            self.left = True
            await self._disconnect(ReasonCode.SERVER_SHUTTING_DOWN, self.config.server_reference)

    def cut(self) -> None:
        if self.tasks is not None:
            self.tasks.cancel_scope.cancel()

    async def close(self) -> None:
        pass  # run() let go of the session already

    async def _disconnect(self, reason: int, server_reference: str | None = None) -> None:
        await self._handle_and_flush(self.mqtt.disconnect(reason, server_reference=server_reference))
        self.cut()

    def _handle_later(self, events: list[MqttEvent]) -> None:
        if self.tasks is not None:
            self.tasks.start_soon(self._handle_and_flush, events)

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self.tasks = tg
                tg.start_soon(self._read)
                tg.start_soon(self._tick)
        finally:
            self.tasks = None  # drain() and a takeover notice now find nothing to start
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()
                await self._session_over()

    async def _read(self) -> None:
        while not self.mqtt.closed:
            try:
                data = await self.stream.receive(READ_SIZE)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self._handle(self.mqtt.connection_lost())
                break
            async with self.reading:
                if self.left:
                    break  # the worker sent DISCONNECT meanwhile: what came after is not acknowledged (resent)
                await self._handle_and_flush(self.mqtt.receive_bytes(data, time.monotonic()))
        await self._flush()
        assert self.tasks is not None
        self.tasks.cancel_scope.cancel()

    async def _tick(self) -> None:
        while True:
            deadline = self.mqtt.next_deadline()
            await anyio.sleep(1.0 if deadline is None else max(0.0, deadline - time.monotonic()))
            await self._handle_and_flush(self.mqtt.tick(time.monotonic()))
            if self.mqtt.closed:
                assert self.tasks is not None
                self.tasks.cancel_scope.cancel()

    async def _flush(self) -> None:
        async with self.write_lock:
            data = self.mqtt.outbound()
            if data:
                try:
                    await self.stream.send(data)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass

    async def _handle_and_flush(self, events: list[MqttEvent]) -> None:
        try:
            await self._handle(events)
        except REDIS_FAILURES as exc:
            # Redis failing over: nothing the client sent since its last acknowledgement is
            # acknowledged, so its MQTT client sends it again once it has reconnected (5.0: told
            # why, Server busy; 3.1.1 has no reason to give). The worker and the session stay.
            failure = redis_failure(exc, "an MQTT request", self.services.core.fences)
            log.info("MQTT connection of %r closed: %s", self.session.client_id, failure.message[:200])
            self.mqtt.disconnect(ReasonCode.SERVER_BUSY, failure.resp()[:256])
            await self._flush()
            self.cut()
            return
        await self._flush()

    async def _handle(self, events: list[MqttEvent]) -> None:
        # What one read brought is handled in runs: consecutive PUBLISHes to one topic are one
        # publish call, the acknowledgements of one read one ACK per subscription.
        publishes: list[MessagePublished] = []
        acks: list[DeliveryAcknowledged] = []
        for event in events:
            if isinstance(event, MessagePublished):
                if publishes and not self._same_run(publishes[-1], event):
                    await self._published(publishes)
                    publishes = []
                publishes.append(event)
                continue
            if publishes:
                await self._published(publishes)
                publishes = []
            if isinstance(event, DeliveryAcknowledged):
                acks.append(event)
            elif isinstance(event, ConnectRequested):
                await self._connect(event)
            elif isinstance(event, SubscribeRequested):
                await self._subscribe(event)
            elif isinstance(event, UnsubscribeRequested):
                await self._unsubscribe(event)
            elif isinstance(event, ConnectionClosed):
                await self._acknowledged(acks)
                acks = []
                await self._closed(event)
            elif isinstance(event, DeliveryReceived):
                # The client has the message (PUBREC): settle it now, so it is never sent again;
                # what remains, PUBREL/PUBCOMP, is the handshake's, and a resumed session ends it.
                held = self.in_flight.pop(event.packet_id, None)
                self.releasing.add(event.packet_id)
                if held is not None:
                    handle, tag, _msg = held
                    await self.services.core.leases.ack(handle, [tag])
            elif isinstance(event, PublishReleased):
                pass  # the session machine keeps the inbound QoS 2 handshake; the message is stored already
        if publishes:
            await self._published(publishes)
        if acks:
            await self._acknowledged(acks)

    @staticmethod
    def _same_run(a: MessagePublished, b: MessagePublished) -> bool:
        return (a.topic == b.topic and a.qos == b.qos and not a.retain and not b.retain
                and a.properties == b.properties)

    # -- events --------------------------------------------------------------------------------

    def _granted_expiry(self, protocol_level: int, expiry: int) -> int:
        if protocol_level == 4 and expiry == SESSION_NEVER_EXPIRES:
            # 3.1.1 Clean Session 0 has no expiry of its own: a long server default
            return min(self.config.mqtt_default_session_expiry_s, self.config.mqtt_max_session_expiry_s)
        return expiry

    async def _connect(self, event: ConnectRequested) -> None:
        session = self.session
        if self.services.config.needs_auth:
            user = None
            if event.password is not None:
                user = await self.verbs._authenticate(event.username or "default", event.password)
            if user is None:
                self.mqtt.refuse(ReasonCode.BAD_USER_NAME_OR_PASSWORD)
                return
            session.authed, session.user = True, user
        try:
            await session.bind(event.client_id, anonymous=False, takeover=True, fresh=event.clean_start)
        except FenceMQError as exc:
            log.info("MQTT CONNECT of %r refused: %s", event.client_id, exc)
            self.mqtt.refuse(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
            return
        self.protocol_level = event.protocol_level
        self.expiry = self._granted_expiry(event.protocol_level, event.session_expiry_interval)
        if event.will is not None:
            self.will = (event.will, event.will.properties.will_delay_interval or 0)
        redis, keys = self.services.redis, self.services.keys
        held = await session_index.non_lite_handles(redis, keys, event.client_id)
        fields = await redis.hgetall(keys.session(event.client_id))
        saved = {k.decode()[len(SUB_FIELD):]: v for k, v in fields.items() if k.startswith(SUB_FIELD.encode())}
        releasing: list[int] = []
        recorded: list[int] = []
        if any(f.encode() in fields for f in (INFLIGHT_FIELD, RELEASING_FIELD, RECORDED_FIELD)):
            await redis.hdel(keys.session(event.client_id), INFLIGHT_FIELD, RELEASING_FIELD, RECORDED_FIELD)
            if not event.clean_start:
                self.resumed_ids = json.loads(fields.get(INFLIGHT_FIELD.encode()) or b"{}")
                releasing = json.loads(fields.get(RELEASING_FIELD.encode()) or b"[]")
                recorded = json.loads(fields.get(RECORDED_FIELD.encode()) or b"[]")
        if event.clean_start:
            for handle in held:
                await self.services.core.subscriptions.unsubscribe(handle)
            held = []
            if saved:
                await redis.hdel(keys.session(event.client_id), *[SUB_FIELD + f for f in saved])
            saved = {}
        pipelined = self.mqtt.accept(time.monotonic(), session_present=bool(held or releasing or recorded),
                                     inbound_releases=frozenset(recorded))
        for packet_id in releasing:  # received before the connection dropped: complete the handshake
            self.mqtt.resend_release(packet_id)
            self.releasing.add(packet_id)
        if releasing:
            await self._flush()
        for handle in held:  # a resumed session: its subscriptions deliver again, with their options
            owner = handle.queue.owner or ""
            shared = owner.startswith("$share/")
            filt = f"{owner}/{handle.queue.topic}" if shared else handle.queue.topic
            qos, no_local, rap, ident = json.loads(saved[filt]) if filt in saved else (1, False, False, None)
            self._start_delivery(filt, MqttSubscription(handle, qos, shared, no_local, rap, ident))
        # what the client sent right behind its CONNECT (a SUBSCRIBE, say) waited for the accept
        await self._handle(pipelined)

    async def _published(self, run: list[MessagePublished]) -> None:
        first = run[0]
        reason = ReasonCode.SUCCESS
        try:
            self.verbs._may(self.session, "publish", first.topic)
            headers = headers_of(first.qos, first.retain, first.properties, await self.services.clock.now_ms())
            for start in range(0, len(run), self.services.config.max_batch):
                part = run[start:start + self.services.config.max_batch]
                await self.services.core.shared.publish(
                    first.topic, [e.payload for e in part], qos=min(first.qos, 1),
                    headers=headers, retain=first.retain, producer=self.session.client_id)
        except NoPermission:
            reason = ReasonCode.NOT_AUTHORIZED
        except FenceMQError as exc:
            log.info("MQTT PUBLISH to %r refused: %s", first.topic[:128], exc)
            reason = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
        for event in run:
            if event.packet_id is not None:
                self.mqtt.acknowledge_publish(event.packet_id, reason)

    async def _subscribe(self, event: SubscribeRequested) -> None:
        codes = []
        client = self.session.client_id
        assert client is not None
        for request in event.requests:
            if request.refusal is not None:
                codes.append(request.refusal)
                continue
            user = self.session.user
            if user is not None and not user.may_subscribe(request.filter):
                codes.append(ReasonCode.NOT_AUTHORIZED)
                continue
            qos, options = request.granted_qos, request.options
            shared = request.share_group is not None
            try:
                sub = await self.services.core.shared.subscribe(client, request.topic_filter, qos=min(qos, 1),
                                                                retained=False)
            except FenceMQError as exc:
                log.info("MQTT SUBSCRIBE to %r refused: %s", request.topic_filter[:128], exc)
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
            await self.services.redis.hset(self.services.keys.session(client), SUB_FIELD + request.topic_filter,
                                           mine.saved())
            # Retain Handling (MQTT-3.3.1-9/10/11): 0 at every SUBSCRIBE, 1 only for a new
            # subscription, 2 never; never to a shared subscription (MQTT 5.0 §4.8.2)
            if not shared and (options.retain_handling == 0 or (options.retain_handling == 1 and sub.new_member)):
                await self._send_retained(mine.handle, request.filter)
            if mine is not before:
                self._start_delivery(request.topic_filter, mine)
            codes.append(qos)
        self.mqtt.complete_subscribe(event.packet_id, codes)

    async def _send_retained(self, handle: Handle, filt: str) -> None:
        stored = await self.services.redis.hgetall(self.services.keys.retained)
        bodies = [as_sent_for_subscribe(body) for topic, body in stored.items() if matches(filt, topic.decode())]
        publishing = self.services.core.shared.publishing
        for start in range(0, len(bodies), self.config.max_batch):
            await publishing.append(handle.queue, bodies[start:start + self.config.max_batch])

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
            await self.services.redis.hdel(self.services.keys.session(client), SUB_FIELD + filt)
            codes.append(ReasonCode.SUCCESS)
        self.mqtt.complete_unsubscribe(event.packet_id, codes)

    async def _acknowledged(self, events: list[DeliveryAcknowledged]) -> None:
        settled: dict[Handle, list[str]] = {}
        refused: dict[Handle, list[str]] = {}
        for event in events:
            if event.packet_id in self.releasing:  # PUBCOMP of a delivery settled at its PUBREC
                self.releasing.discard(event.packet_id)
                continue
            held = self.in_flight.pop(event.packet_id, None)
            if held is not None:
                handle, tag, _msg = held
                # refused by the client (>= 0x80): dropped, never redispatched (MQTT-234)
                (refused if event.reason_code >= 0x80 else settled).setdefault(handle, []).append(tag)
        if events:
            self.quota_freed.set()
        leases = self.services.core.leases
        for handle, tags in settled.items():
            await leases.ack(handle, tags)
        for handle, tags in refused.items():
            await leases.nack(handle, tags, discard=True)

    async def _closed(self, event: ConnectionClosed) -> None:
        self.taken_over = event.taken_over
        if self.session.bound:
            # a DISCONNECT may change the Session Expiry Interval (5.0 §3.14.2.2.2)
            self.expiry = self._granted_expiry(self.protocol_level, event.session_expiry_interval)
        if event.will is None:
            self.will = None  # DISCONNECT 0x00 deleted it (MQTT-3.1.2-10)
        elif self.will is not None:
            self.will = (event.will, self.will[1])
