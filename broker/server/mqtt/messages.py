"""MQTT message properties kept as FenceMQ message headers, and back.

A FenceMQ message has a payload and string headers; an MQTT 5 message has properties. The
listener stores the properties as headers named ``mqtt-…`` (so RESP consumers see them too)
and turns them back into properties when it delivers to an MQTT client. Headers a RESP
publisher set (any name not starting with ``mqtt-``) reach MQTT 5 clients as user properties.

* ``mqtt-qos: 2``: published at QoS 2 (Redis keeps it at least once; a QoS 2 subscriber gets 2)
* ``mqtt-retain: 1``: published with RETAIN (Retain As Published gives the flag back)
* ``mqtt-retained: subscribe``: a retained message sent because of a SUBSCRIBE (RETAIN 1 on the wire)
* ``mqtt-expires-ms``: the message expiry, as a deadline on Redis's clock (ms), so the interval
  counts down while stored and a retained copy expires when the original would; the same header
  a RESP ``PUB … TTL`` writes, and the one the fences read (model/messages.py ``EXPIRES``)
* ``mqtt-format``, ``mqtt-content-type``, ``mqtt-response-topic``, ``mqtt-correlation`` (base64),
  ``mqtt-user`` (JSON list of pairs: order and repeated names kept, MQTT-3.3.2-17/18)
"""

from __future__ import annotations

import base64
import json

from fencemq.fences.publish import expiry_deadline
from fencemq.model.messages import EXPIRES, _read_fragment, pack_body
from fencemq.protocol.mqtt.properties import NO_PROPERTIES, Properties

PREFIX = "mqtt-"
QOS = "mqtt-qos"
RETAIN = "mqtt-retain"
RETAINED = "mqtt-retained"
FORMAT = "mqtt-format"
CONTENT_TYPE = "mqtt-content-type"
RESPONSE_TOPIC = "mqtt-response-topic"
CORRELATION = "mqtt-correlation"
USER = "mqtt-user"


def headers_of(qos: int, retain: bool, props: Properties, now_ms: int) -> dict[str, str] | None:
    """The headers that keep what a PUBLISH (or a will) said beyond its payload; None: nothing."""
    h: dict[str, str] = {}
    if qos == 2:
        h[QOS] = "2"
    if retain:
        h[RETAIN] = "1"
    if props.message_expiry_interval is not None:
        # the one expiry rule of every door (fences/publish.py), as PUB … TTL: the fences settle it unsent
        h[EXPIRES] = str(expiry_deadline(now_ms, props.message_expiry_interval * 1000))
    if props.payload_format_indicator is not None:
        h[FORMAT] = str(props.payload_format_indicator)
    if props.content_type is not None:
        h[CONTENT_TYPE] = props.content_type
    if props.response_topic is not None:
        h[RESPONSE_TOPIC] = props.response_topic
    if props.correlation_data is not None:
        h[CORRELATION] = base64.b64encode(props.correlation_data).decode()
    if props.user_properties:
        h[USER] = json.dumps(props.user_properties)
    return h or None


def remaining_expiry(headers: dict[str, str], now_ms: int) -> int | None:
    """Seconds the message has left (None: it never expires; <= 0: expired, MQTT-3.3.2-5)."""
    at = headers.get(EXPIRES)
    if at is None:
        return None
    left_ms = int(at) - now_ms
    return -1 if left_ms <= 0 else (left_ms + 999) // 1000


def properties_of(headers: dict[str, str], expiry: int | None, subscription_id: int | None) -> Properties:
    """The properties to deliver with (MQTT-3.3.2-6: the remaining expiry; MQTT-3.3.4-3: the
    subscription's identifier)."""
    if not headers and expiry is None and subscription_id is None:
        return NO_PROPERTIES
    users: list[tuple[str, str]] = []
    if USER in headers:
        users = [(str(k), str(v)) for k, v in json.loads(headers[USER])]
    users += [(k, v) for k, v in headers.items() if not k.startswith(PREFIX)]
    correlation = headers.get(CORRELATION)
    fmt = headers.get(FORMAT)
    return Properties(
        payload_format_indicator=int(fmt) if fmt is not None else None,
        message_expiry_interval=expiry,
        content_type=headers.get(CONTENT_TYPE),
        response_topic=headers.get(RESPONSE_TOPIC),
        correlation_data=base64.b64decode(correlation) if correlation is not None else None,
        subscription_identifiers=(subscription_id,) if subscription_id else (),
        user_properties=tuple(users),
    )


def as_sent_for_subscribe(body: bytes) -> bytes:
    """A retained message's stored body, marked as sent because of a SUBSCRIBE (RETAIN 1 on the
    wire, MQTT-3.3.1-9). A body of the older msgpack form is returned as it is."""
    parts = body.split(b":", 4)
    if len(parts) < 5 or parts[2][:1] != b"R":
        return body
    qos, _bucket, form, who_len, rest = parts
    n = int(who_len)
    topic, headers, payload = _read_fragment(rest[n:], int(form[1:]))
    return pack_body(payload, {**headers, RETAINED: "subscribe"}, int(qos), rest[:n].decode() if n else None,
                     topic.decode() if topic is not None else None)
