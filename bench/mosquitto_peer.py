"""The peer of bench.fanout: Mosquitto (the machine's, on 1883) with a `$share` group of 2 paho subscribers.

    python -m bench.mosquitto_peer [--messages 10000] [--size 128] [--port 1883]

One paho publisher sends ``messages`` QoS 1 PUBLISHes to ``fanpeer<k>/t``, at most
``WINDOW`` ahead of what the subscribers have received (Mosquitto queues at most 1,000
messages per client by default and drops the rest of a flood: an unpaced flood measures
its drops, not its speed); two paho subscribers share ``$share/g/fanpeer<k>/#`` at QoS 1
(paho acknowledges each message as it is handed over). Reported: messages per second from the
first publish to the last message received, and publish -> receive latency percentiles.
Mosquitto keeps its messages in memory; FenceMQ's go through Redis: the comparison is what
a user moving from one to the other would see. Returns ``{"skipped": reason}`` when no
broker answers on the port.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from typing import Any

from bench.stats import percentiles_ms
from bench.workloads import _STAMP

SUBSCRIBERS = 2
WINDOW = 500  # published but not yet received, at most (below Mosquitto's default queue of 1,000 per client)


def _reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def mosquitto_share(total: int, size: int, port: int = 1883, timeout: float = 60.0) -> dict[str, Any]:
    if not _reachable(port):
        return {"skipped": f"no MQTT broker on 127.0.0.1:{port}"}
    import paho.mqtt.client as mqtt

    topic_base = f"fanpeer{int(time.time() * 1000)}"
    pad = b"x" * max(0, size - _STAMP.size)
    received = 0
    latencies: list[int] = []
    lock = threading.Condition()
    done = threading.Event()
    t_last = 0.0

    def on_message(_client: Any, _userdata: Any, msg: Any) -> None:
        nonlocal received, t_last
        now = time.time_ns()
        with lock:
            latencies.append(now - _STAMP.unpack_from(msg.payload)[0])
            received += 1
            lock.notify()
            if received >= total:
                t_last = time.perf_counter()
                done.set()

    subscribers = []
    for i in range(SUBSCRIBERS):
        sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{topic_base}-s{i}", protocol=mqtt.MQTTv5)
        sub.on_message = on_message
        sub.connect("127.0.0.1", port)
        sub.loop_start()
        sub.subscribe(f"$share/g/{topic_base}/#", qos=1)
        subscribers.append(sub)
    time.sleep(0.5)  # the subscriptions are in place before the first publish
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{topic_base}-p", protocol=mqtt.MQTTv5)
    pub.max_inflight_messages_set(1000)
    pub.connect("127.0.0.1", port)
    pub.loop_start()
    try:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        for sent in range(total):
            with lock:
                while sent - received >= WINDOW and time.monotonic() < deadline:
                    lock.wait(0.5)
            pub.publish(f"{topic_base}/t", _STAMP.pack(time.time_ns()) + pad, qos=1)
        finished = done.wait(max(0.0, deadline - time.monotonic()))
    finally:
        for c in (pub, *subscribers):
            c.loop_stop()
            c.disconnect()
    if not finished:
        return {"messages": total, "received": received, "error": f"not all received in {timeout:.0f} s"}
    seconds = t_last - t0
    return {"messages": total, "seconds": seconds, "msgs_per_s": total / seconds,
            "latency_ms": percentiles_ms(latencies)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--port", type=int, default=1883)
    opts = ap.parse_args(argv)
    print(mosquitto_share(opts.messages, opts.size, opts.port))


if __name__ == "__main__":
    main()
