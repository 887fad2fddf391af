"""What the SDK makes of a worker's replies: decoded values, and its two errors.

Replies arrive as RESP2 or RESP3 (a map may be a flat array) and as bytes;
the SDK hands out str keys and values, ``Delivery`` objects and notice dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from itertools import repeat
from operator import attrgetter
from typing import Any

from fencemq.errors import ConnectionLost, EndOfStream, FenceMQError  # noqa: F401 (re-exported)
from fencemq.model.messages import Delivery


def _str(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _tree(value: Any) -> Any:
    """Bytes to str all the way down (notices, HELLO)."""
    if isinstance(value, (bytes, bytearray)):
        return _str(value)
    if isinstance(value, dict):
        return {_str(k): _tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tree(v) for v in value]
    return value


def _map(raw: Any) -> dict[str, Any]:
    """A RESP3 map, or its RESP2 form (a flat field/value array), keyed by str."""
    if isinstance(raw, dict):
        return {_str(k): v for k, v in raw.items()}
    if isinstance(raw, list) and len(raw) % 2 == 0:
        return {_str(raw[i]): raw[i + 1] for i in range(0, len(raw), 2)}
    raise FenceMQError(f"expected a map reply, got {raw!r:.200}")


def _notice(raw: Any) -> dict[str, Any]:
    return {k: _tree(v) for k, v in _map(raw).items()}


def _delivery(raw: Any) -> Delivery:
    # The hot path of every PULL and TAKE: fields looked up by their bytes names, not a str-keyed
    # copy. One that is not as the worker writes it (str keys, a field missing) is read the slow way,
    # which says what is wrong.
    try:
        if type(raw) is list:
            return WireDelivery.flat(raw)
        if type(raw) is dict:
            return WireDelivery(raw)
    except (KeyError, IndexError):
        pass
    return _delivery_slowly(raw)


def _deliveries(raw: Any) -> list[Delivery]:
    """A PULL reply's deliveries (none for a nil reply). The usual reply, all flat arrays (CLIENT
    DELIVERIES FLAT, or RESP2) or all maps, is read with no Python step per message but the
    delivery's own; any other, one by one."""
    if not raw:
        return []
    try:
        if all(map(isinstance, raw, repeat(list))):
            return list(map(WireDelivery.flat, raw))
        if all(map(isinstance, raw, repeat(dict))):
            return list(map(WireDelivery, raw))
    except (KeyError, IndexError):
        pass
    return [_delivery(r) for r in raw]


def _strs(raw: Any) -> list[str]:
    """A list of bytes (MPUB's ids) as str, each decoded as :func:`_str` does."""
    try:
        return [v.decode("utf-8", "replace") for v in raw]
    except AttributeError:  # not all bytes: each by itself
        return [_str(v) for v in raw]


def _lazy(name: str, decode: Callable[[WireDelivery, dict[bytes, Any]], Any]) -> property:
    """A field of a :class:`WireDelivery`, decoded from the reply on first read and kept in the
    Delivery's own slot (a write goes there too)."""
    slot = getattr(Delivery, name)  # the dataclass's slot, which the property hides

    def read(self: WireDelivery) -> Any:
        try:
            return slot.__get__(self)
        except AttributeError:
            value = decode(self, self._fields())
            slot.__set__(self, value)
            return value

    def write(self: WireDelivery, value: Any) -> None:
        slot.__set__(self, value)

    return property(read, write, doc=f"``{name}``, decoded from the reply when first read")


def _maybe_text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "replace")


class WireDelivery(Delivery):
    """A delivery as the worker's reply holds it: the tag and epoch (which every reply's fence
    and every settle reads) decoded at once, every other field when the application first reads
    it. A consumer that acks by tag, or reads only the payload, decodes nothing more."""

    __slots__ = ("_reply",)

    def __init__(self, reply: dict[bytes, Any]) -> None:
        self.tag = reply[b"tag"].decode()
        self.epoch = int(reply[b"epoch"])
        self._reply = reply

    @classmethod
    def flat(cls, reply: list[Any]) -> WireDelivery:
        """From a flat array of fields and values: the worker writes ``id``, ``tag`` and ``epoch``
        first in every delivery, so those two are read by place (KeyError: not such an array)."""
        if len(reply) % 2 or reply[2] != b"tag" or reply[4] != b"epoch":
            raise KeyError(b"tag")
        d = cls.__new__(cls)
        d.tag = reply[3].decode()
        d.epoch = int(reply[5])
        d._reply = reply
        return d

    def _fields(self) -> dict[bytes, Any]:
        """The reply as a map by field name, made from a flat array the first time a field is read."""
        reply = self._reply
        if type(reply) is list:
            reply = self._reply = dict(zip(reply[::2], reply[1::2]))
        return reply

    id = _lazy("id", lambda d, m: m[b"id"].decode())
    topic = _lazy("topic", lambda d, m: m[b"topic"].decode("utf-8", "replace"))
    payload = _lazy("payload", lambda d, m: bytes(m[b"payload"]))
    deliveries = _lazy("deliveries", lambda d, m: int(m.get(b"deliveries", 1)))
    ts = _lazy("ts", lambda d, m: int(m.get(b"ts", 0)))
    lmq = _lazy("lmq", lambda d, m: _maybe_text(m.get(b"lmq")))
    headers = _lazy("headers", lambda d, m: {_str(k): _str(v) for k, v in _map(h).items()}
                    if (h := m.get(b"headers")) else {})
    qos = _lazy("qos", lambda d, m: _granted(d.tag) if (q := m.get(b"qos")) is None else int(q))
    producer = _lazy("producer", lambda d, m: None if (p := m.get(b"producer")) is None else _str(p))

    def __eq__(self, other: object) -> bool:  # by value, as a Delivery (the dataclass's asks for one class)
        if not isinstance(other, Delivery):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _FIELDS)

    __hash__ = None  # type: ignore[assignment]  # like Delivery: mutable, compared by value


_FIELDS = tuple(f.name for f in fields(Delivery))


def _delivery_slowly(raw: Any) -> Delivery:
    m = _map(raw)
    headers = m.get("headers")
    lmq = m.get("lmq")
    producer = m.get("producer")
    tag = _str(m["tag"])
    return Delivery(
        id=_str(m["id"]),
        tag=tag,
        epoch=int(m["epoch"]),
        topic=_str(m["topic"]),
        payload=bytes(m["payload"]),
        deliveries=int(m.get("deliveries", 1)),
        ts=int(m.get("ts", 0)),
        lmq=None if lmq is None else _str(lmq),
        headers={_str(k): _str(v) for k, v in _map(headers).items()} if headers else {},
        qos=int(m["qos"]) if "qos" in m else _granted(tag),
        producer=None if producer is None else _str(producer),
    )


def _granted(tag: str) -> int:
    """A delivery's QoS: its tag says (docs/protocol.md: a QoS 0 delivery's tag starts with ``q``)."""
    return 0 if tag.startswith("q") else 1


def _tag(t: str | bytes | Delivery) -> str | bytes:
    return t.tag if isinstance(t, Delivery) else t


_TAG_OF, _EPOCH_OF = attrgetter("tag"), attrgetter("epoch")


def _tags(given: tuple[str | bytes | Delivery, ...]) -> list[str | bytes]:
    """The tags of what a settle was given: deliveries, tags, or both mixed (each element looked at
    in C when they are all deliveries, the usual ACK of a pulled batch)."""
    if all(map(isinstance, given, repeat(Delivery))):
        return list(map(_TAG_OF, given))
    return list(map(_tag, given))
