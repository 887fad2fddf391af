"""What the SDK makes of a worker's replies: decoded values, and its two errors.

Replies arrive as RESP2 or RESP3 (a map may be a flat array) and as bytes;
the SDK hands out str keys and values, ``Delivery`` objects and notice dicts.
"""

from __future__ import annotations

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
    # The hot path of every PULL: fields looked up by their bytes names, not a str-keyed copy.
    m = raw if isinstance(raw, dict) else (dict(zip(raw[::2], raw[1::2])) if isinstance(raw, list) else None)
    if not m or not isinstance(next(iter(m)), bytes):
        return _delivery_slowly(raw)
    get = m.get
    headers, lmq, producer, qos = get(b"headers"), get(b"lmq"), get(b"producer"), get(b"qos")
    tag = m[b"tag"].decode()
    return Delivery(
        m[b"id"].decode(), tag, int(m[b"epoch"]), m[b"topic"].decode("utf-8", "replace"),
        bytes(m[b"payload"]), int(get(b"deliveries", 1)), int(get(b"ts", 0)),
        None if lmq is None else lmq.decode("utf-8", "replace"),
        {_str(k): _str(v) for k, v in _map(headers).items()} if headers else {},
        _granted(tag) if qos is None else int(qos),
        None if producer is None else _str(producer),
    )


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
