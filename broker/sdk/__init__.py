"""The client library: an asyncio ``Client``, a blocking ``SyncClient``, lite subscriptions.

It imports only the model and the errors of the broker (docs/architecture.md).
"""

from fencemq.errors import ConnectionLost, EndOfStream, SessionExpired, SessionTakenOver
from fencemq.model.messages import Delivery
from fencemq.sdk.client import Client
from fencemq.sdk.lite import LiteSubscriptions
from fencemq.sdk.reconnect import Reconnect
from fencemq.sdk.renewal import LockRenewer
from fencemq.sdk.subscription import Subscription
from fencemq.sdk.sync import SyncClient, SyncSubscription

__all__ = ["Client", "ConnectionLost", "Delivery", "EndOfStream", "LiteSubscriptions", "LockRenewer", "Reconnect",
           "SessionExpired", "SessionTakenOver", "Subscription", "SyncClient", "SyncSubscription"]
