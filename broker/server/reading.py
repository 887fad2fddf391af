"""One read buffer for every connection of the process (RESP and MQTT over TCP or TLS).

A connection's protocol hands the event loop this buffer to read into (``get_buffer``) and copies
what it keeps when told how much arrived (``buffer_updated``); the loop makes the two calls back to
back, so nothing is ever read into it while another connection still needs it. No connection
holds a read buffer of its own, and a flood is read in steps of at most READ_SIZE bytes.
"""

from __future__ import annotations

READ_SIZE = 65536
BUFFER = bytearray(READ_SIZE)
VIEW = memoryview(BUFFER)


def received(nbytes: int) -> bytes:
    """What the last read put in the buffer."""
    return bytes(VIEW[:nbytes])
