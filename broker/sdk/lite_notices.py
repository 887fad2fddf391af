"""Where a client's notices go among its LiteSubscriptions (fencemq.sdk.lite): by (topic, group).

One router per client, kept on the client itself (no global registry that could keep it alive),
hooked in front of its ``on_notice``: a lite ``unsubscribe`` notice goes to the LiteSubscriptions
of its (topic, group), and the client's own ``reconnected`` and ``session_expired`` to all of them.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from fencemq.errors import FenceMQError
from fencemq.model.handles import Handle
from fencemq.sdk.client import Client

Notice = dict[str, Any]


class Member(Protocol):
    """What the router needs of a LiteSubscriptions."""

    def _hint(self, notice: Notice) -> None: ...
    def _wake_now(self) -> None: ...
    def _session_gone(self) -> None: ...


class _Router:
    """Per client: routes pushed and drained notices to its LiteSubscriptions by (topic, group)."""

    def __init__(self, client: Client) -> None:
        self.client = weakref.ref(client)
        self.members: dict[tuple[str, str], Member] = {}
        self.previous = client.on_notice
        client.on_notice = self.on_push

    def on_push(self, notice: Notice) -> None:
        kind = notice.get("type")
        if kind == "reconnected":
            # pushes sent while the client was away went nowhere: a SYNC now re-sends the notice of
            # every lmq it was evicted from meanwhile (an evicted lmq stays evicted: no SUB is sent)
            for member in list(self.members.values()):
                member._wake_now()
        elif kind == "session_expired":
            for member in list(self.members.values()):
                member._session_gone()
        else:
            self.route(notice, pushed=True)
        if self.previous is not None:
            self.previous(notice)

    def route(self, notice: Notice, *, pushed: bool) -> Member | None:
        key = _lite_key(notice)
        owner = self.members.get(key) if key is not None else None
        if owner is not None and pushed:
            owner._hint(notice)
        return owner

    def detach(self) -> None:
        client = self.client()
        if client is not None and client.on_notice == self.on_push:
            client.on_notice = self.previous


_ATTR = "_fencemq_lite_router"  # kept on the client itself: no global registry that could keep it alive


def _router(client: Client, create: bool = False) -> _Router | None:
    router = getattr(client, _ATTR, None)
    if router is None and create:
        router = _Router(client)
        setattr(client, _ATTR, router)
    return router


def _lite_key(notice: Notice) -> tuple[str, str] | None:
    """(topic, group) of a lite unsubscribe notice, else None."""
    if notice.get("type") != "unsubscribe" or notice.get("lmq") is None:
        return None
    try:
        h = Handle.decode(str(notice.get("handle", "")))
    except FenceMQError:
        return None
    return (h.queue.topic, h.group) if h.queue.lite else None
