"""The client library: an asyncio ``Client``, a blocking ``SyncClient``, lite subscriptions.

It imports only the model and the errors of the broker (docs/architecture.md).
"""

from fencemq.errors import ConnectionLost, EndOfStream, SessionTakenOver
from fencemq.model.messages import Delivery
from fencemq.sdk.client import Client
from fencemq.sdk.lite import LiteSubscriptions
from fencemq.sdk.renewal import LockRenewer
from fencemq.sdk.subscription import Subscription
from fencemq.sdk.sync import SyncClient, SyncSubscription

__all__ = ["Client", "ConnectionLost", "Delivery", "EndOfStream", "LiteSubscriptions", "LockRenewer",
           "SessionTakenOver", "Subscription", "SyncClient", "SyncSubscription"]
