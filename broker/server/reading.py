"""One read buffer per event loop for every connection it serves (RESP and MQTT over TCP or TLS).

A connection's protocol hands the event loop this buffer to read into (``get_buffer``) and copies
what it keeps when told how much arrived (``buffer_updated``); one loop makes the two calls back to
back, so nothing is read into it while another of its connections still needs it. No connection
holds a read buffer of its own, and a flood is read in steps of at most READ_SIZE bytes.

The buffer is the thread's, not the process's: an event loop runs in one thread, and two loops of
one process (two workers embedded in one application, as the tests run them) read at the same time
(uvloop reads with the GIL released), so one buffer for both handed one client's bytes to another.
"""

from __future__ import annotations

import threading

READ_SIZE = 65536
_per_thread = threading.local()


def buffer() -> memoryview:
    """The calling thread's read buffer, made at its first read."""
    try:
        return _per_thread.view
    except AttributeError:
        view = _per_thread.view = memoryview(bytearray(READ_SIZE))
        return view


def received(nbytes: int) -> bytes:
    """What the last read of this thread put in its buffer."""
    return bytes(_per_thread.view[:nbytes])
