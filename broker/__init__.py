"""FenceMQ: a message broker whose state lives in Redis and whose guarantees are Lua fences.

Applications write ``from fencemq import Client`` (asyncio) or ``SyncClient``
(blocking). The SDK is imported on first use, so ``import fencemq.spark`` (the
analytics job, which ships alone) pulls in nothing of the broker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_SDK = ("Client", "SyncClient", "Subscription", "SyncSubscription", "Delivery", "ConnectionLost", "EndOfStream",
        "LiteSubscriptions", "LockRenewer", "Reconnect", "SessionExpired", "SessionTakenOver")

__all__ = ["__version__", *_SDK]

if TYPE_CHECKING:
    from fencemq.sdk import (  # noqa: F401 (type checkers see the lazy names)
        Client, ConnectionLost, Delivery, EndOfStream, LiteSubscriptions, LockRenewer, Reconnect, SessionExpired,
        SessionTakenOver, Subscription, SyncClient, SyncSubscription,
    )


def __getattr__(name: str) -> Any:
    if name in _SDK:
        from fencemq import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'fencemq' has no attribute {name!r}")
