"""Handles a client cannot forge: every handle a worker hands out carries a MAC of the fleet's secret.

A handle names a queue, a group and a member (fencemq.model.handles.Handle);
the fences check membership, and on top of that a worker refuses a handle
it did not issue before any fence runs. The secret lives in Redis
(``keys.handle_secret``, made once by whichever worker starts first), so
every worker of a broker signs and checks alike, and a handle survives a
reconnect to another worker. The MAC is appended as ``.<mac>``: the handle
stays readable (the SDK reads its member and queue), it only can't be made up.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from typing import Any

from fencemq.errors import BadArgument, NoPermission
from fencemq.model.handles import Handle

MAC_BYTES = 12  # 96 bits: a forger's guess is refused, and every wrong guess costs a round trip
MAX_HANDLE_CHARS = 2048  # a handle is a few hundred characters; anything longer is not one
VERIFIED_KEPT = 4096  # handles checked once and remembered (a consumer names its handle on every PULL and ACK)


class HandleSigner:
    def __init__(self, secret: bytes = b"") -> None:
        self.secret = secret
        self._verified: dict[str, Handle] = {}  # signed handle -> what it names; only ever what verify() passed

    async def load(self, redis: Any, key: str) -> None:
        """The fleet's secret: made by the first worker (SET NX), read by every other."""
        await redis.set(key, os.urandom(32).hex(), nx=True)
        raw = await redis.get(key)
        self.secret = bytes.fromhex(raw.decode() if isinstance(raw, bytes) else raw)
        self._verified.clear()

    def _mac(self, bare: str) -> str:
        digest = hmac.new(self.secret, bare.encode(), hashlib.sha256).digest()[:MAC_BYTES]
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def sign(self, handle: str) -> str:
        bare = handle.split(".", 1)[0]
        return f"{bare}.{self._mac(bare)}"

    def verify(self, text: str) -> Handle:
        """The handle, if this broker issued it; NOPERM for a forged or altered one."""
        known = self._verified.get(text)
        if known is not None:
            return known
        if len(text) > MAX_HANDLE_CHARS:
            raise BadArgument("that is not a subscription handle (too long); use the handle SUB returned")
        bare, dot, mac = text.partition(".")
        if not dot or not hmac.compare_digest(mac.encode(), self._mac(bare).encode()):
            Handle.decode(bare)  # BADARG for what is no handle at all
            raise NoPermission("this handle was not issued by this broker, or was altered; "
                               "use the handle SUB returned")
        handle = Handle.decode(bare)
        if len(self._verified) >= VERIFIED_KEPT:
            self._verified.clear()
        self._verified[text] = handle
        return handle

    def sign_notice(self, notice: Any) -> Any:
        """A notice as the client sees it: its handle (if any) signed."""
        if isinstance(notice, dict) and isinstance(notice.get("handle"), str) and notice["handle"]:
            notice = {**notice, "handle": self.sign(notice["handle"])}
        return notice
