"""TLS for clients, at every door that speaks it (RESP, MQTT over TCP and over WebSocket).

The worker's certificate (``tls_cert_file``, ``tls_key_file``) and, for mutual TLS, the CA whose
client certificates it accepts (``tls_ca_file``). Every listener wraps its TCP listener with
:func:`guarded_tls`: the handshake runs in the connection's own task, within the gate's
``tls_handshake_timeout_ms``, and a failed or stalled one is one INFO line, never a traceback.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import anyio
from anyio.abc import SocketAttribute
from anyio.streams.tls import TLSListener

from fencemq.config import Config
from fencemq.errors import BadArgument

log = logging.getLogger(__name__)


def client_tls(config: Config) -> ssl.SSLContext | None:
    """The TLS context clients connect with, or None for plain TCP."""
    if not config.tls_cert_file and not config.tls_key_file:
        if config.tls_ca_file:
            raise BadArgument("tls_ca_file needs tls_cert_file and tls_key_file (the worker's own certificate)")
        return None
    if not (config.tls_cert_file and config.tls_key_file):
        raise BadArgument("TLS needs both tls_cert_file and tls_key_file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    if config.tls_ca_file:
        context.load_verify_locations(config.tls_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def guarded_tls(listener: Any, context: ssl.SSLContext, gate: Any) -> "QuietTLSListener":
    """``listener`` with TLS: a handshake not done within the gate's timeout is dropped, quietly."""
    return QuietTLSListener(listener, context, standard_compatible=False, handshake_timeout=gate.handshake_timeout_s)


class QuietTLSListener(TLSListener):
    """A failed or stalled handshake is one log line (who, why), never a traceback."""

    @staticmethod
    async def handle_handshake_error(exc: BaseException, stream: Any) -> None:
        peer = ""
        try:
            peer = ":".join(map(str, stream.extra(SocketAttribute.remote_address)[:2]))
        except Exception:  # noqa: BLE001 - only for the log line: a socket already gone has no address
            pass
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(stream)
        if isinstance(exc, anyio.get_cancelled_exc_class()) or not isinstance(exc, Exception):
            raise exc
        why = "no handshake within the timeout" if isinstance(exc, TimeoutError) else \
            (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        log.info("TLS handshake with %s failed: %s", peer or "a client", why)
