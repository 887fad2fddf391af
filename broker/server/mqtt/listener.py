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
  Interval or at the session's end if sooner, unless a new connection takes the session up first:
  kept in the session's hash from CONNECT, scheduled in Redis for its delay (server/mqtt/wills.py).
* Message properties travel as `mqtt-*` headers (server/mqtt/messages.py); subscription options
  (identifier, No Local, Retain As Published, Retain Handling) shape each delivery.

`--mqtt-ws-port` serves the same over WebSocket (server/mqtt/websocket.py).

Only `accept`ed sessions touch Redis; each subscription has a task that pulls from its mailbox
in batches as the client's Receive Maximum allows and waits on the queue's wake channel
(server/mqtt/delivery.py); the connection's end — in-flight handed back, the session ended or
lingering, the will — is server/mqtt/departure.py's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc

from fencemq.errors import EvictingRedis, FenceMQError, Full, LimitExceeded, NoPermission, WrongPassword
from fencemq.fences.redis_errors import REDIS_FAILURES, redis_failure
from fencemq.fences.sessions import SessionEnding
from fencemq.protocol.mqtt.client_ids import session_name
from fencemq.protocol.mqtt.codec import MQTT_5
from fencemq.protocol.mqtt.events import (
    SESSION_NEVER_EXPIRES, ConnectionClosed, ConnectRequested, DeliveryAcknowledged, DeliveryReceived,
    MessagePublished, MqttEvent, MqttServerLimits, PublishReleased, SubscribeRequested, UnsubscribeRequested,
)
from fencemq.protocol.mqtt.packets import Will
from fencemq.protocol.mqtt.reasons import ReasonCode
from fencemq.protocol.mqtt.session import MqttServerSession, SessionState
from fencemq.server.mqtt.messages import (
    headers_of,
)
from fencemq.server.mqtt.delivery import MqttDelivery, MqttSubscription, filter_of
from fencemq.server.mqtt.departure import MqttDeparture
from fencemq.server.mqtt.driving import MqttDriving
from fencemq.server.mqtt.resumption import MqttResumption
from fencemq.server.mqtt.state import InFlight, MqttSessionState, dedup_id
from fencemq.server.mqtt.subscribing import MqttSubscribing
from fencemq.server.mqtt.wire import NOBODY_WAITS, ConnectionTasks, QuietLock
from fencemq.server.gate import Pass
from fencemq.server.session import Session

log = logging.getLogger(__name__)



def _nothing() -> None:
    pass


def server_limits(config: Any, gate: Any) -> MqttServerLimits:
    """What the worker's MQTT sessions accept and announce: the gate's budgets (the time to an accepted
    CONNECT, its size before authentication) and the configured session expiry and keep alive."""
    return MqttServerLimits(maximum_session_expiry_interval=config.mqtt_max_session_expiry_s,
                            connect_timeout=gate.connect_timeout_s, maximum_connect_size=gate.preauth_max_bytes,
                            server_keep_alive=config.mqtt_server_keep_alive_s or None)


class MqttConnection(MqttDriving, MqttDelivery, MqttDeparture, MqttSubscribing, MqttResumption):
    # Slots: an idle connection holds its attributes in a compact object (an instance dict of this
    # many keys is not shared between instances: ~1.6 KB each).
    __slots__ = ("worker", "services", "verbs", "config", "gate", "stream", "mqtt", "revoked_filters", "gate_pass",
                 "session", "token", "write_lock", "output_turn", "quota_freed", "subscriptions", "in_flight",
                 "resumed_ids", "mqtt_state", "nonce", "completed", "releasing", "tasks", "protocol_level", "expiry",
                 "taken_over", "ended_by_server", "quota_refused", "draining", "left", "will", "will_kept", "_spawn",
                 "_over", "_queue", "admission_done",
                 "_working", "_ending", "_caught_up", "_deadlines", "_tick_at", "_request_timer")

    def __init__(self, worker: Any, token: str, gate_pass: Pass | None = None,
                 limits: MqttServerLimits | None = None) -> None:
        self.worker, self.services, self.verbs = worker, worker.services, worker.verbs
        self.config = worker.config
        self.gate = self.services.gate
        self.stream: Any = None  # what carries its bytes (mqtt/wire.py), once attached
        self.mqtt = MqttServerSession(limits or server_limits(self.config, self.gate), now=time.monotonic())
        self.revoked_filters: tuple[str, ...] = ()  # a resumed session's, its user may no longer subscribe to
        self.gate_pass = gate_pass or Pass("mqtt", "")
        self.gate_pass.shut_out = self._shut_out
        self.session = Session(self.services, token, watch_for_hangup=self._no_hangup_watch,
                               end_connection=self._taken_over, gate_pass=self.gate_pass)
        self.token = token
        self.write_lock = QuietLock()
        self.output_turn = QuietLock()
        self.quota_freed: Any = NOBODY_WAITS  # an event while a delivery waits for the client's quota
        self.subscriptions: dict[str, MqttSubscription] = {}  # by topic filter as the client sent it
        self.in_flight: dict[int, InFlight] = {}  # packet id -> the delivery sent with it
        self.resumed_ids: dict[str, int] = {}  # "<handle>|<message id>" -> the packet id it was sent with
        self.mqtt_state: MqttSessionState = None  # type: ignore[assignment]  # in Redis, once CONNECT names it
        self.nonce = ""  # the session's own id, in its QoS 2 publishes' dedup ids (mqtt/state.py)
        self.completed: dict[int, int] = {}  # packet id -> the client's QoS 2 publishes completed with it
        # QoS 2 deliveries the client received (PUBREC): settled in FenceMQ, awaiting PUBCOMP
        self.releasing: set[int] = set()
        self.tasks: ConnectionTasks | None = None
        self.protocol_level = 0
        self.expiry = 0  # seconds the session outlives the connection (the FenceMQ session's lease then)
        self.taken_over = False
        self.ended_by_server = False
        self.quota_refused = False  # a 3.1.1 PUBLISH met FULL: the connection is being closed unacknowledged
        self.draining = False  # the worker shuts down: nothing new is sent
        self.left = False  # the worker is about to DISCONNECT: nothing more is read
        self.will: tuple[Will, int] | None = None  # the will to publish after the connection, and its delay
        self.will_kept = False  # the will is in the session's hash too (mqtt/wills.py)
        # gives back its place among the connections in their connect phase (server/admission.py)
        self.admission_done: Callable[[], None] = _nothing
        self._not_driven_yet()

    def _no_hangup_watch(self, scope: anyio.CancelScope | None) -> None:
        pass  # MQTT verbs never wait inside the session: the reader runs all along

    def _taken_over(self) -> None:
        self._handle_later(self.mqtt.take_over())

    def _shut_out(self) -> None:
        """The gate ends this connection (its user's record changed): DISCONNECT 0x98 (5.0), then close."""
        if self.tasks is not None and not self.mqtt.closed:
            self.tasks.start_soon(self._disconnect, ReasonCode.ADMINISTRATIVE_ACTION)

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
        # Reading stops, what was read is handled (its PUBACKs written), then the DISCONNECT: a PUBLISH
        # is never stored with its PUBACK cut off (the client would send it again elsewhere, stored twice)
        self.left = True
        with anyio.move_on_after(bound_s):
            await self.caught_up()
        await self._disconnect(ReasonCode.SERVER_SHUTTING_DOWN, self.config.server_reference)

    async def close(self) -> None:
        pass  # its end let go of the session already

    async def _disconnect(self, reason: int, server_reference: str | None = None) -> None:
        await self._handle_and_flush(self.mqtt.disconnect(reason, server_reference=server_reference))
        self.cut()

    def _handle_later(self, events: list[MqttEvent]) -> None:
        if self.tasks is not None:
            self._handle_soon(events)

    async def _flush(self) -> None:
        async with self.write_lock:
            data = self.mqtt.outbound()
            if data:
                await self._write(data)

    async def _handle_and_flush(self, events: list[MqttEvent]) -> None:
        try:
            await self._handle(events)
        except REDIS_FAILURES as exc:
            # Redis failing over: nothing the client sent since its last acknowledgement is
            # acknowledged, so its MQTT client sends it again once it has reconnected (5.0: told
            # why, Server busy; 3.1.1 has no reason to give). The worker and the session stay.
            failure = redis_failure(exc, "an MQTT request", self.services.core.fences)
            if self.mqtt.state is SessionState.CONNECTING:
                # a CONNECT not answered yet is refused with CONNACK Server busy (3.1.1: Server
                # unavailable), never a close the client cannot tell from a network fault
                log.info("MQTT CONNECT of %r refused: %s", self.session.client_id, failure.message[:200])
                self.mqtt.refuse(ReasonCode.SERVER_BUSY, failure.resp()[:256])
                await self._flush()
                return
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
                await self._received(event.packet_id)
            elif isinstance(event, PublishReleased):
                # the message is stored already: forget its packet id (the next publish with it is
                # a new message), then PUBCOMP
                self.completed[event.packet_id] = await self.mqtt_state.completed(event.packet_id)
                self.mqtt.complete_release(event.packet_id)
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
        try:
            await self._connect_admitted(event)
        finally:
            self.admission_done()  # its CONNECT is answered (or failed): the next waiting connection's turn

    async def _connect_admitted(self, event: ConnectRequested) -> None:
        session = self.session
        refusal = await self._admitted(event)
        if self.mqtt.closed:
            return  # the client hung up while the gate made it wait
        if refusal is not None:
            self.mqtt.refuse(refusal)
            return
        name = session_name(event.client_id)  # any UTF-8 identifier, as a FenceMQ session name
        self.mqtt_state = MqttSessionState(self.services.core.ctx.linked, self.services.keys, name)
        try:
            revoked = await session.bind(name, anonymous=False, takeover=True, fresh=event.clean_start,
                                         tell_revoked=False)
        except SessionEnding as exc:
            # its session is being ended this moment (BIND_WAIT_S and more): connect again shortly
            log.info("MQTT CONNECT of %r refused: %s", event.client_id, exc)
            self.mqtt.refuse(ReasonCode.SERVER_BUSY, exc.resp()[:256])
            return
        except FenceMQError as exc:
            log.info("MQTT CONNECT of %r refused: %s", event.client_id, exc)
            self.mqtt.refuse(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
            return
        if revoked:
            # its user may no longer subscribe to these: left, and told in the CONNACK (5.0)
            log.info("MQTT session %r resumed without %d subscriptions its user may no longer hold",
                     event.client_id, len(revoked))
            self.revoked_filters = tuple(filter_of(h) for h in revoked)
            for filt in self.revoked_filters:
                await self.mqtt_state.unsubscribed(filt)
        self.protocol_level = event.protocol_level
        self.expiry = self._granted_expiry(event.protocol_level, event.session_expiry_interval)
        if event.will is not None:
            self.will = (event.will, event.will.properties.will_delay_interval or 0)
            self.will_kept = True
        # what the client sent right behind its CONNECT (a SUBSCRIBE, say) waited for the accept
        pipelined = await self._take_up(event)
        # the keep alive is the session's deadline now, not the connect timeout (a client whose
        # Keep Alive is shorter than that was checked only at the connect timeout: its will late)
        self._arm_tick()
        await self._handle(pipelined)

    async def _admitted(self, event: ConnectRequested) -> int | None:
        """The gate's answer to a CONNECT: None (let in), or the CONNACK reason code that refuses it."""
        gate = self.gate
        user = None
        if gate.needs_auth:
            if event.password is None:
                return ReasonCode.BAD_USER_NAME_OR_PASSWORD
            try:
                user = await gate.log_in(self.gate_pass, event.username, event.password)
            except WrongPassword:
                return ReasonCode.BAD_USER_NAME_OR_PASSWORD
            except LimitExceeded as exc:
                log.info("MQTT CONNECT of %r refused: %s", event.client_id, exc)
                return ReasonCode.QUOTA_EXCEEDED
            self.session.authed = True
        if event.will is not None and not gate.allows(user, "publish", event.will.topic):
            # a will is a publish, checked now and again when it goes out (MQTT-3.1.2-… as Mosquitto)
            log.info("MQTT CONNECT of %r refused: %s (its will)", event.client_id,
                     user.missing("publish", event.will.topic) if user else "")
            return ReasonCode.NOT_AUTHORIZED
        return None

    async def _published(self, run: list[MessagePublished]) -> None:
        """PUBLISHes to one topic that one read brought: published together, each packet checked as
        if alone and acknowledged with its own reason code, in order (MQTT-4.6.0-2)."""
        first = run[0]
        try:
            self.gate.check(self.session.user, "publish", first.topic)
        except NoPermission:
            outcomes: list[Any] = [NoPermission("")] * len(run)
        else:
            shared = self.services.core.shared
            headers = headers_of(first.qos, first.retain, first.properties, await self.services.clock.now_ms())
            # a QoS 2 publish is stored under a dedup id of its own (mqtt/state.py): sent again after
            # a crash that came before it was recorded, it is not stored twice
            dedup = [[dedup_id(self.nonce, e.packet_id, self.completed.get(e.packet_id, 0))]
                     if e.qos == 2 and e.packet_id is not None else None for e in run]
            if first.retain:  # never merged (_same_run): the last retained message is this one
                try:
                    outcomes = [await shared.publish(first.topic, [first.payload], qos=min(first.qos, 1),
                                                     headers=headers, retain=True, dedup_ids=dedup[0],
                                                     producer=self.session.client_id)]
                except FenceMQError as exc:
                    outcomes = [exc]
            else:
                outcomes = await shared.publish_many(first.topic, [[e.payload] for e in run], qos=min(first.qos, 1),
                                                     headers=headers, producer=self.session.client_id, dedup_ids=dedup)
            # the session knows the QoS 2 ones before their PUBRECs go out (MQTT-4.3.3-10)
            await self.mqtt_state.recorded([e.packet_id for e, out in zip(run, outcomes, strict=True)
                                            if e.qos == 2 and e.packet_id is not None and isinstance(out, list)])
        for event, outcome in zip(run, outcomes, strict=True):
            if isinstance(outcome, REDIS_FAILURES):
                # Unknown whether it was stored: the connection ends unacknowledged and the client
                # sends it (and what followed it) again.
                raise outcome
            why = None
            if isinstance(outcome, NoPermission):
                reason = ReasonCode.NOT_AUTHORIZED
            elif isinstance(outcome, (Full, EvictingRedis)):
                # the broker's Redis is short of memory (or may evict): held back, as a RESP PUB gets FULL
                log.info("MQTT PUBLISH to %r refused: %s", first.topic[:128], outcome.resp())
                if self.mqtt.protocol_level != MQTT_5:
                    # 3.1.1 has no failure PUBACK: close with this one (and what follows) unacknowledged,
                    # and the client sends it again once it reconnects (MQTT-4.4.0-1)
                    if not self.quota_refused and self.tasks is not None:
                        self.quota_refused = True
                        self.tasks.start_soon(self._disconnect, ReasonCode.QUOTA_EXCEEDED)
                    return
                reason, why = ReasonCode.QUOTA_EXCEEDED, outcome.resp()
            elif isinstance(outcome, FenceMQError):
                log.info("MQTT PUBLISH to %r refused: %s", first.topic[:128], outcome)
                reason = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
            else:
                reason = ReasonCode.SUCCESS
            if event.packet_id is not None:
                self.mqtt.acknowledge_publish(event.packet_id, reason, why)

    async def _closed(self, event: ConnectionClosed) -> None:
        self.taken_over = event.taken_over
        # the server ended it (a protocol error, a limit, a DISCONNECT it sent): the client is told why
        # (a client silent past its keep alive is gone: nothing to linger for)
        self.ended_by_server = (event.initiated_by == "server" and not event.taken_over
                                and event.reason_code != ReasonCode.KEEP_ALIVE_TIMEOUT)
        if self.session.bound:
            # a DISCONNECT may change the Session Expiry Interval (5.0 §3.14.2.2.2)
            self.expiry = self._granted_expiry(self.protocol_level, event.session_expiry_interval)
        if event.will is None:
            self.will = None  # DISCONNECT 0x00 deleted it (MQTT-3.1.2-10)
        elif self.will is not None:
            self.will = (event.will, self.will[1])
