"""MQTT clients on a worker: the anyio shell around the sans-I/O session (protocol/mqtt_session.py).

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
* The will is published when the connection ends without DISCONNECT 0x00.

Only `accept`ed sessions touch Redis; each subscription has a task that pulls from its mailbox
in batches as the client's Receive Maximum allows and waits on the queue's wake channel.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import anyio.abc
from anyio.streams.tls import TLSListener

from fencemq.errors import FenceMQError, NoPermission, NotFound
from fencemq.fences import session_index
from fencemq.model.keys import Handle
from fencemq.protocol.mqtt_events import (
    ConnectionClosed, ConnectRequested, DeliveryAcknowledged, DeliveryReceived, MessagePublished, MqttEvent,
    MqttServerLimits, PublishReleased, SubscribeRequested, UnsubscribeRequested,
)
from fencemq.protocol.mqtt_reasons import ReasonCode
from fencemq.protocol.mqtt_session import MqttServerSession
from fencemq.server.session import Session

log = logging.getLogger(__name__)

BATCH = 64  # deliveries fetched per pull, at most (and at most the client's send quota)
IDLE_LOOK_S = 1.0  # a subscription with nothing to send looks again at least this often
READ_SIZE = 65536
REFUSED = 0x80  # the SUBACK reason code "unspecified error"
# Redis keeps QoS 2 as QoS 1 (at least once); the header remembers what the publisher asked for,
# so a QoS 2 subscriber gets it at QoS 2 and a RESP one sees it as a header
QOS_HEADER = "mqtt-qos"
QOS2_HEADER = {QOS_HEADER: "2"}


class MqttConnection:
    def __init__(self, worker: Any, stream: anyio.abc.ByteStream, token: str) -> None:
        self.worker, self.services, self.verbs = worker, worker.services, worker.verbs
        self.stream = stream
        self.mqtt = MqttServerSession(MqttServerLimits(), now=time.monotonic())
        self.session = Session(self.services, token, watch_for_hangup=self._no_hangup_watch,
                               end_connection=self._taken_over)
        self.write_lock = anyio.Lock()
        self.quota_freed = anyio.Event()
        self.subscriptions: dict[str, tuple[Handle, int, anyio.CancelScope]] = {}  # filter -> handle, qos, task
        self.in_flight: dict[int, tuple[Handle, str]] = {}  # packet id -> handle, tag
        self.tasks: anyio.abc.TaskGroup | None = None
        self.expiry = 0

    async def _no_hangup_watch(self, scope: anyio.CancelScope) -> None:
        await anyio.sleep_forever()  # MQTT verbs never wait inside the session: the reader runs all along

    def _taken_over(self) -> None:
        self._handle_later(self.mqtt.take_over())

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
            with anyio.CancelScope(shield=True):
                if self.session.bound and self.expiry == 0:
                    self.session.quit = True  # a clean session ends with its connection
                await self.session.release()
                await self.stream.aclose()

    async def _read(self) -> None:
        while not self.mqtt.closed:
            try:
                data = await self.stream.receive(READ_SIZE)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self._handle(self.mqtt.connection_lost())
                break
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
        await self._handle(events)
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
            elif isinstance(event, (PublishReleased, DeliveryReceived)):
                pass  # the session machine keeps the QoS 2 handshake; the message is stored already
        if publishes:
            await self._published(publishes)
        if acks:
            await self._acknowledged(acks)

    @staticmethod
    def _same_run(a: MessagePublished, b: MessagePublished) -> bool:
        return a.topic == b.topic and a.qos == b.qos and not a.retain and not b.retain

    # -- events --------------------------------------------------------------------------------

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
            await session.bind(event.client_id, anonymous=False, takeover=True)
        except FenceMQError as exc:
            log.info("MQTT CONNECT of %r refused: %s", event.client_id, exc)
            self.mqtt.refuse(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
            return
        self.expiry = event.session_expiry_interval
        held = await session_index.non_lite_handles(self.services.redis, self.services.keys, event.client_id)
        if event.clean_start:
            for handle in held:
                await self.services.core.subscriptions.unsubscribe(handle)
            held = []
        pipelined = self.mqtt.accept(time.monotonic(), session_present=bool(held))
        for handle in held:  # a resumed session: its subscriptions deliver again
            owner = handle.queue.owner or ""
            filt = f"{owner}/{handle.queue.topic}" if owner.startswith("$share/") else handle.queue.topic
            self._start_delivery(filt, handle, 1)
        # what the client sent right behind its CONNECT (a SUBSCRIBE, say) waited for the accept
        await self._handle(pipelined)

    async def _published(self, run: list[MessagePublished]) -> None:
        first = run[0]
        reason = ReasonCode.SUCCESS
        try:
            self.verbs._may(self.session, "publish", first.topic)
            for start in range(0, len(run), self.services.config.max_batch):
                part = run[start:start + self.services.config.max_batch]
                await self.services.core.shared.publish(
                    first.topic, [e.payload for e in part], qos=min(first.qos, 1),
                    headers=QOS2_HEADER if first.qos == 2 else None, retain=first.retain,
                    producer=self.session.client_id)
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
            qos = request.granted_qos
            try:
                sub = await self.services.core.shared.subscribe(client, request.topic_filter, qos=min(qos, 1))
            except FenceMQError as exc:
                log.info("MQTT SUBSCRIBE to %r refused: %s", request.topic_filter[:128], exc)
                codes.append(REFUSED)
                continue
            self._start_delivery(request.topic_filter, Handle.decode(sub.handle), qos)
            codes.append(qos)
        self.mqtt.complete_subscribe(event.packet_id, codes)

    async def _unsubscribe(self, event: UnsubscribeRequested) -> None:
        codes = []
        for filt in event.filters:
            held = self.subscriptions.pop(filt, None)
            if held is None:
                codes.append(ReasonCode.NO_SUBSCRIPTION_EXISTED)
                continue
            handle, _qos, scope = held
            scope.cancel()
            await self.services.core.subscriptions.unsubscribe(handle)
            codes.append(ReasonCode.SUCCESS)
        self.mqtt.complete_unsubscribe(event.packet_id, codes)

    async def _acknowledged(self, events: list[DeliveryAcknowledged]) -> None:
        settled: dict[Handle, list[str]] = {}
        refused: dict[Handle, list[str]] = {}
        for event in events:
            held = self.in_flight.pop(event.packet_id, None)
            if held is not None:
                handle, tag = held
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
        if event.taken_over:
            self.expiry = 1  # the new connection owns the session now: leave it be
        will = event.will
        if will is not None and self.session.bound:
            try:
                await self.services.core.shared.publish(will.topic, [will.payload], qos=min(will.qos, 1),
                                                        retain=will.retain, producer=self.session.client_id)
            except FenceMQError as exc:
                log.info("MQTT will of %r not published: %s", self.session.client_id, exc)

    # -- deliveries ----------------------------------------------------------------------------

    def _start_delivery(self, filt: str, handle: Handle, qos: int) -> None:
        old = self.subscriptions.pop(filt, None)
        if old is not None:
            old[2].cancel()
        scope = anyio.CancelScope()
        self.subscriptions[filt] = (handle, qos, scope)
        assert self.tasks is not None
        self.tasks.start_soon(self._deliver, handle, qos, scope)

    async def _deliver(self, handle: Handle, qos: int, scope: anyio.CancelScope) -> None:
        leases, wakeups = self.services.core.leases, self.services.wakeups
        with scope:
            async with wakeups.watching(self.services.keys.queue(handle.queue).wake) as waiter:
                while not self.mqtt.closed:
                    quota = self.mqtt.send_quota if qos else BATCH
                    if quota <= 0:
                        self.quota_freed = anyio.Event()
                        await self.quota_freed.wait()
                        continue
                    try:
                        result = await leases.pull(handle, min(quota, BATCH))
                    except NotFound:
                        log.info("MQTT subscription %s of %r ended", handle.queue, self.session.client_id)
                        return  # the subscription is gone (its queue dropped): nothing more to send
                    if not result.deliveries:
                        with anyio.move_on_after(IDLE_LOOK_S):
                            await waiter.wait()
                        continue
                    await self._send(handle, qos, result.deliveries)

    async def _send(self, handle: Handle, qos: int, deliveries: list[Any]) -> None:
        settle_now = []
        async with self.write_lock:
            for d in deliveries:
                granted = min(qos, int(d.headers.get(QOS_HEADER, d.qos)) if d.headers else d.qos)
                sent = self.mqtt.deliver(d.topic, d.payload, granted, dup=d.deliveries > 1 and granted > 0)
                if sent.packet_id is not None:
                    self.in_flight[sent.packet_id] = (handle, d.tag)
                elif not d.tag.startswith("q"):
                    settle_now.append(d.tag)  # QoS 0 to this client, or too big for it: done
            data = self.mqtt.outbound()
            if data:
                await self.stream.send(data)
        if settle_now:
            await self.services.core.leases.ack(handle, settle_now)


async def serve_mqtt(worker: Any, port: int | None, tls: Any, *, ws_port: int | None = None,
                     task_status: anyio.abc.TaskStatus[int | None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Accept MQTT connections until cancelled: over TCP on ``port``, over WebSocket on ``ws_port``
    (either may be None: off; both with TLS when the worker has certificates). Reports the TCP
    port it listens on and sets ``worker.mqtt_ws_port``."""
    from anyio.abc import SocketAttribute

    from fencemq.server.mqtt_websocket import MqttWebSocketStream, WebSocketRefused

    numbers = iter(range(1, 1 << 62))

    async def listen(at: int) -> tuple[Any, int]:
        listener: Any = await anyio.create_tcp_listener(local_host=worker.config.host, local_port=at)
        bound = listener.extra(SocketAttribute.local_port)
        if tls is not None:
            listener = TLSListener(listener, tls, standard_compatible=False)
        return listener, bound

    async def one(stream: anyio.abc.ByteStream) -> None:
        try:
            await MqttConnection(worker, stream, f"{worker.id}:mqtt{next(numbers)}").run()
        except Exception:
            log.exception("MQTT connection failed")

    async def one_ws(stream: anyio.abc.ByteStream) -> None:
        ws = MqttWebSocketStream(stream)
        try:
            with anyio.fail_after(MqttServerLimits().connect_timeout):
                await ws.handshake()
        except (WebSocketRefused, TimeoutError) as exc:
            log.info("MQTT WebSocket refused: %s", exc)
            await stream.aclose()
            return
        await one(ws)

    listeners = []
    tcp_bound = None
    if port is not None:
        listener, tcp_bound = await listen(port)
        listeners.append((listener, one))
    if ws_port is not None:
        listener, worker.mqtt_ws_port = await listen(ws_port)
        listeners.append((listener, one_ws))
    async def serve(listener: Any, handler: Any) -> None:
        async with listener:
            await listener.serve(handler)

    task_status.started(tcp_bound)
    async with anyio.create_task_group() as tg:
        for listener, handler in listeners:
            tg.start_soon(serve, listener, handler)
