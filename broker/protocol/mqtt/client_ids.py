"""An MQTT client identifier as the name of the FenceMQ session it binds.

MQTT allows any UTF-8 string up to 65,535 bytes as a client identifier (a server MAY accept more
than MQTT-3.1.3-5's 23 alphanumerics, and brokers do: Mosquitto, EMQX). A FenceMQ session name is
printable ASCII without spaces or ``|``, at most 128 bytes (``model.keys.check_name``): it is part
of key names, handles and RESP replies. So the session of an MQTT client is named:

* the identifier itself, when it is a session name already and has no ``%`` (an MQTT client and
  a RESP client that name ``sensor-1`` share one session, as before);
* else the identifier percent-encoded: its UTF-8 bytes outside printable ASCII, space, ``|`` and
  ``%`` as ``%XX`` (``clean retained`` is ``clean%20retained``, ``capteur-é`` is
  ``capteur-%C3%A9``);
* and when that is longer than 128 bytes, its first 64 bytes (whole ``%XX`` only), ``%~`` and the
  first 32 hex digits of the identifier's SHA-256.

A session name with ``%`` in it came from an MQTT identifier this way, and no two identifiers get
one name: percent-encoding is one to one, ``%~`` never occurs in it, and the hash is SHA-256's.
"""

from __future__ import annotations

import hashlib
import re

from fencemq.model.keys import MAX_NAME_BYTES

_PLAIN = re.compile(r"[\x21-\x24\x26-\x7b\x7d\x7e]+")  # printable ASCII but '%' and '|'
_KEPT = frozenset(range(0x21, 0x7F)) - {ord("%"), ord("|")}
HASHED_PREFIX_BYTES = 64
HASH_HEX_DIGITS = 32


def session_name(client_id: str) -> str:
    """The FenceMQ session an MQTT client identifier binds (see the module's docstring)."""
    if len(client_id) <= MAX_NAME_BYTES and _PLAIN.fullmatch(client_id):
        return client_id
    encoded = "".join(chr(b) if b in _KEPT else f"%{b:02X}" for b in client_id.encode("utf-8"))
    if len(encoded) <= MAX_NAME_BYTES:
        return encoded
    head = encoded[:HASHED_PREFIX_BYTES]
    cut = head.rfind("%", len(head) - 2)  # a %XX cut short is left out whole
    if cut >= 0:
        head = head[:cut]
    digest = hashlib.sha256(client_id.encode("utf-8")).hexdigest()[:HASH_HEX_DIGITS]
    return f"{head}%~{digest}"
