"""Subscription handles: the self-describing token SUB returns and PULL, ACK and the rest take back."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import msgpack

from fencemq.errors import BadArgument
from fencemq.model.keys import QueueRef


@dataclass(frozen=True, slots=True)
class Handle:
    """A subscription handle: which queue, group and member it speaks for.

    Handles are self-describing so a stateless worker routes PULL/ACK without a
    lookup; a worker only honours a handle whose member is the caller's own
    client id, so a forged handle gains nothing.
    """

    queue: QueueRef
    group: str
    member: str

    def encode(self) -> str:
        fields = [1, self.queue.topic, self.queue.lmq, self.group, self.member]
        if self.queue.owner is not None:
            fields.append(self.queue.owner)
        packed = msgpack.packb(fields)
        return "h" + base64.urlsafe_b64encode(packed).rstrip(b"=").decode()

    @staticmethod
    def decode(text: str) -> "Handle":
        try:
            if not text.startswith("h"):
                raise ValueError
            # a worker appends ".<mac>" (server/handles.py): the fields are what comes before
            raw = text[1:].split(".", 1)[0]
            version, topic, lmq, group, member, *owner = msgpack.unpackb(
                base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
            )
            if version != 1 or len(owner) > 1:
                raise ValueError
            if not all(isinstance(v, str) for v in (topic, group, member, *owner)) or not isinstance(lmq, (str, type(None))):
                raise ValueError
        except Exception:
            raise BadArgument(f"'{text[:64]}' is not a subscription handle; use the handle SUB returned") from None
        return Handle(QueueRef(topic, lmq, owner[0] if owner else None), group, member)
