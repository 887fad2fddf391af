"""`fencemq demo`: a scripted tour of the guarantees, against a real worker and Redis.

Every client here is plain redis-py (``execute_command``): any Redis client
can talk to a worker. The demo checks what it shows and fails (exit 1) if a
guarantee did not hold.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from fencemq.cli.common import text

ORDERS = 20
ORDERS_TOPIC = "orders"
GROUP = "billing"
CAROL_LOCK_MS = 500
CHAT_TOPIC, CHAT_LMQ = "chat", "session-42"
REDELIVERY_WAIT_S = 5.0  # the lease is 0.5 s and the sweeper runs every 0.1 s: ~0.6 s in practice


def as_map(reply: Any) -> dict[str, Any]:
    """A RESP3 map (or RESP2 flat field/value array) with str keys and str/int values."""
    if isinstance(reply, list):
        reply = dict(zip(reply[::2], reply[1::2]))
    out: dict[str, Any] = {}
    for k, v in reply.items():
        if isinstance(v, list):
            v = [text(x) for x in v]
        elif isinstance(v, bytes):
            v = text(v)
        out[text(k)] = v
    return out


@dataclass
class Actor:
    """One client connection = one client id = one session."""

    name: str
    style: str
    conn: redis.Redis
    note: str = ""
    handle: str | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    acked: int = 0
    ends_as: str = "active"

    def cmd(self, *args: Any) -> Any:
        return self.conn.execute_command(*args)

    def label(self) -> Text:
        return Text(f"{self.name:>8}", style=f"bold {self.style}")


def _payloads(deliveries: list[dict[str, Any]]) -> str:
    parts = []
    for d in deliveries:
        extra = f" (delivery #{d['deliveries']})" if int(d["deliveries"]) > 1 else ""
        payload = d["payload"]
        parts.append(f"{payload!r}{extra}" if " " in payload else f"{payload}{extra}")
    return ", ".join(parts) if parts else "(nothing)"


class Demo:
    def __init__(self, console: Console, port: int, host: str = "127.0.0.1", mqtt_port: int | None = None) -> None:
        self.console = console
        self.host, self.port, self.mqtt_port = host, port, mqtt_port
        self.actors: list[Actor] = []
        self.checks: list[tuple[str, bool]] = []
        self.t0 = time.monotonic()

    # -- plumbing ----------------------------------------------------------------

    def connect(self, name: str, style: str, note: str = "") -> Actor:
        conn = redis.Redis(host=self.host, port=self.port, protocol=3, single_connection_client=True,
                           socket_timeout=15, socket_connect_timeout=5)
        actor = Actor(name, style, conn, note)
        hello = as_map(actor.cmd("HELLO", 3, "SETNAME", name))
        self.actors.append(actor)
        self.say(actor, f"HELLO 3 SETNAME {name}", f"session {hello['id']}")
        return actor

    def say(self, actor: Actor | None, command: str, result: str = "", style: str = "") -> None:
        line = Text("  ")
        line.append_text(actor.label() if actor else Text(" " * 8))
        line.append("  ")
        line.append(command, style="bold")
        if result and command:
            line.append("  →  ", style="dim")
        if result:
            line.append(result, style=style)
        self.console.print(line)

    def step(self, title: str, explain: str) -> None:
        self.console.print()
        self.console.print(Text(title, style="bold underline"))
        self.console.print(Text(explain, style="dim"))

    def check(self, what: str, ok: bool) -> None:
        self.checks.append((what, ok))
        mark = Text("  ✔ ", style="bold green") if ok else Text("  ✘ ", style="bold red")
        self.console.print(mark + Text(what, style="green" if ok else "red"))

    def pull(self, actor: Actor, count: int, block_ms: int | None = None, show: bool = True) -> list[dict[str, Any]]:
        args: list[Any] = ["PULL", actor.handle, "COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        deliveries = [as_map(d) for d in actor.cmd(*args)]
        actor.received.extend(deliveries)
        if show:
            cmd = f"PULL COUNT {count}" + (f" BLOCK {block_ms}" if block_ms is not None else "")
            self.say(actor, cmd, _payloads(deliveries))
        return deliveries

    def ack(self, actor: Actor, deliveries: list[dict[str, Any]], show: bool = True) -> int:
        if not deliveries:
            return 0
        settled = int(actor.cmd("ACK", actor.handle, *[d["tag"] for d in deliveries]))
        actor.acked += settled
        if show:
            self.say(actor, f"ACK {len(deliveries)} tag(s)", f"{settled} settled")
        return settled

    def close(self) -> None:
        for actor in self.actors:
            try:
                actor.cmd("QUIT")  # ends the session: subscriptions left, nothing lingers
            except redis.RedisError:
                pass
            actor.conn.close()

    # -- the story ---------------------------------------------------------------

    def run(self) -> bool:
        producer = self.connect("producer", "magenta")
        self.shared_group(producer)
        self.lite_preemption(producer)
        if self.mqtt_port is not None:
            self.mqtt_client(producer)
        self.summary()
        return all(ok for _, ok in self.checks)

    def shared_group(self, producer: Actor) -> None:
        self.step("1. A producer publishes 20 orders",
                  "MPUB carries the whole batch into one atomic fence call.")
        payloads = [f"order-{i}" for i in range(1, ORDERS + 1)]
        ids = [text(i) for i in producer.cmd("MPUB", ORDERS_TOPIC, ORDERS, *payloads)]
        self.say(producer, f"MPUB {ORDERS_TOPIC} {ORDERS} order-1 … order-{ORDERS}", f"ids {ids[0]}…{ids[-1]}")
        ours = set(ids)

        self.step(f"2. Three consumers join the shared group {GROUP!r}",
                  "Each message of the topic goes to exactly one member of the group. "
                  f"carol takes a {CAROL_LOCK_MS} ms lease and will never ACK.")
        alice = self.connect("alice", "green", "ACKs everything")
        bob = self.connect("bob", "blue", "ACKs everything")
        carol = self.connect("carol", "yellow", f"LOCK {CAROL_LOCK_MS}, never ACKs")
        for actor, extra in ((alice, []), (bob, []), (carol, ["LOCK", CAROL_LOCK_MS])):
            sub = as_map(actor.cmd("SUB", ORDERS_TOPIC, "GROUP", GROUP, *extra))
            actor.handle = sub["handle"]
            self.say(actor, " ".join(["SUB", ORDERS_TOPIC, "GROUP", GROUP, *map(str, extra)]),
                     f"mode {sub['mode']}, epoch {sub['epoch']}")

        self.step("3. Consuming", "alice and bob pull batches of 5 and ACK them; carol pulls 2 and goes silent.")
        held = self.pull(carol, 2)
        held_ids = {d["id"] for d in held}
        carol_took = time.monotonic()
        turn = 0
        while True:
            actor = (alice, bob)[turn % 2]
            batch = self.pull(actor, 5)
            if not batch:
                break
            self.ack(actor, batch, show=False)
            self.console.print(Text(f"{'':14}ACK {len(batch)} → settled", style="dim"))
            turn += 1

        self.step("4. carol's lease runs out",
                  "Every checkout has a deadline in a sorted set; the sweeper returns expired ones "
                  "(within ~0.1 s) and marks carol suspected.")
        redelivered: list[dict[str, Any]] = []
        deadline = time.monotonic() + REDELIVERY_WAIT_S
        while time.monotonic() < deadline and not held_ids <= {d["id"] for d in redelivered}:
            got = self.pull(bob, 5, block_ms=1000)
            self.ack(bob, got, show=False)
            redelivered += [d for d in got if d["id"] in held_ids]
        waited = time.monotonic() - carol_took
        for d in redelivered:
            self.say(None, "", f"{d['payload']} was redelivered to bob with delivery count {d['deliveries']} "
                     f"({waited:.1f} s after carol took it) and ACKed", style="bold cyan")
        self.check(f"carol's {len(held)} unacked orders were redelivered to bob (delivery count 2)",
                   bool(held) and held_ids <= {d["id"] for d in redelivered}
                   and all(int(d["deliveries"]) >= 2 for d in redelivered))
        after = self.pull(carol, 5)
        # The sweeper queues the notice just after the fence that returned carol's
        # checkouts, so bob may have them before carol's notice is there: look again a little.
        notices: list[dict[str, Any]] = []
        deadline = time.monotonic() + 1.0
        while True:
            notices += [as_map(n) for n in carol.cmd("HEARTBEAT")]
            timeouts = [n for n in notices if n.get("type") == "message_timeout"]
            if timeouts or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        tags = sorted({t for n in timeouts for t in n.get("tags", [])}, key=int)
        self.say(carol, "HEARTBEAT", f"message_timeout notice for tag(s) {', '.join(tags) or '—'}"
                 if timeouts else "(no notice)", style="yellow")
        self.check("carol, suspected, gets nothing new until she settles or renews", not after)
        self.check("carol was told (message_timeout notice)", bool(timeouts))
        carol.ends_as = "suspected (lease expired)"

        acked_ids = [d["id"] for a in (alice, bob) for d in a.received if d["id"] in ours]
        self.check(f"all {ORDERS} orders processed exactly once by alice and bob",
                   len(acked_ids) == ORDERS and set(acked_ids) == ours and alice.acked + bob.acked >= ORDERS)

    def lite_preemption(self, producer: Actor) -> None:
        self.step(f"5. Lite topic {CHAT_TOPIC!r}, lmq {CHAT_LMQ!r}: exclusive, the last subscriber wins",
                  "A lite topic holds many tiny queues (one per chat session). Subscribing to an lmq that "
                  "another client holds preempts it: the owner switches and an eviction marker fences the "
                  "old owner, in one atomic script.")
        a = self.connect("A", "green", f"first owner of {CHAT_LMQ}")
        sub = as_map(a.cmd("SUB", CHAT_TOPIC, "LMQ", CHAT_LMQ))
        a.handle = sub["handle"]
        self.say(a, f"SUB {CHAT_TOPIC} LMQ {CHAT_LMQ}", f"{sub['mode']}, owner {sub.get('owner')}")
        for body in ("hello", "are you there?"):
            producer.cmd("PUB", CHAT_TOPIC, body, "LMQ", CHAT_LMQ)
            self.say(producer, f"PUB {CHAT_TOPIC} {body!r} LMQ {CHAT_LMQ}")
        first = self.pull(a, 1)
        self.ack(a, first)
        unacked = self.pull(a, 1)
        self.console.print(Text(f"{'':14}(A holds {_payloads(unacked)} without ACKing)", style="dim"))

        b = self.connect("B", "blue", f"preempts {CHAT_LMQ}")
        sub_b = as_map(b.cmd("SUB", CHAT_TOPIC, "LMQ", CHAT_LMQ))
        b.handle = sub_b["handle"]
        self.say(b, f"SUB {CHAT_TOPIC} LMQ {CHAT_LMQ}", f"owner {sub_b.get('owner')}: A is preempted",
                 style="bold red")
        producer.cmd("PUB", CHAT_TOPIC, "still there?", "LMQ", CHAT_LMQ)
        self.say(producer, f"PUB {CHAT_TOPIC} 'still there?' LMQ {CHAT_LMQ}")

        fenced = self.pull(a, 10)
        self.say(None, "", "A's PULL is empty: fenced by its eviction marker", style="bold red")
        late = int(a.cmd("ACK", a.handle, *[d["tag"] for d in unacked])) if unacked else 0
        self.say(a, "ACK (its old checkout)", f"{late} settled: a stale tag settles nothing", style="red")
        notices = [as_map(n) for n in a.cmd("HEARTBEAT")]
        unsub = [n for n in notices if n.get("type") == "unsubscribe"]
        shown = ", ".join(f"{n['type']} {n.get('topic')}[{n.get('lmq')}] reason={n.get('reason')} by={n.get('by')}"
                          for n in unsub) or "(no notice)"
        self.say(a, "HEARTBEAT", shown, style="yellow")
        got = self.pull(b, 10)
        self.ack(b, got)
        a.ends_as = "fenced (preempted by B)"
        b.ends_as = f"owner of {CHAT_LMQ}"

        self.check("after preemption A's pulls return nothing", not fenced)
        self.check("A's late ACK settled nothing", late == 0)
        self.check("A got the unsubscribe notice", any(n.get("by") == "B" for n in unsub))
        self.check("B got what A held (redelivered) and what came next",
                   [d["payload"] for d in got] == [d["payload"] for d in unacked] + ["still there?"])

    def mqtt_client(self, producer: Actor) -> None:
        """An MQTT 5 client, spoken with FenceMQ's own sans-I/O codec over a plain socket."""
        import socket

        from fencemq.protocol.mqtt.codec import encode
        from fencemq.protocol.mqtt.packets import Connect, Puback, Publish, Subscribe, SubscriptionOptions
        from fencemq.protocol.mqtt.stream import MqttStreamDecoder

        self.step("6. An MQTT client on the same topics",
                  f"The worker also speaks MQTT 3.1.1/5.0 on port {self.mqtt_port}: a RESP PUB reaches an MQTT "
                  "subscriber, and its PUBACK is the ACK of a FenceMQ checkout.")
        sock = socket.create_connection((self.host, self.mqtt_port), timeout=10)
        decoder = MqttStreamDecoder(protocol_level=5)

        def next_packet() -> Any:
            while True:
                got = decoder.next_packet()
                if got is not None:
                    return got
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("the worker closed the MQTT connection")
                decoder.feed(chunk)

        label = Text(f"{'sensor':>8}", style="bold cyan")
        try:
            sock.sendall(encode(Connect(client_id="sensor", keep_alive=30)))
            connack = next_packet()
            self.console.print(Text("  ") + label + Text(f"  MQTT CONNECT sensor  →  CONNACK {connack.reason_code}"))
            sock.sendall(encode(Subscribe(1, (("alerts/#", SubscriptionOptions(qos=1)),))))
            suback = next_packet()
            self.console.print(Text("  ") + label + Text(f"  MQTT SUBSCRIBE alerts/# QoS 1  →  granted {suback.reason_codes}"))
            producer.cmd("PUB", "alerts/door", "open")
            self.say(producer, "PUB alerts/door open")
            publish = next_packet()
            if isinstance(publish, Publish) and publish.packet_id is not None:
                sock.sendall(encode(Puback(publish.packet_id)))
            self.console.print(Text("  ") + label + Text(
                f"  MQTT PUBLISH {getattr(publish, 'topic', '?')} {getattr(publish, 'payload', b'')!r} "
                f"QoS {getattr(publish, 'qos', '?')}  →  PUBACK"))
        finally:
            sock.close()
        self.check("the MQTT client got the RESP publish at QoS 1",
                   isinstance(publish, Publish) and (publish.topic, publish.payload, publish.qos)
                   == ("alerts/door", b"open", 1))

    def summary(self) -> None:
        self.console.print()
        table = Table(title="Summary", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("client", style="bold")
        table.add_column("subscribed to")
        table.add_column("received", justify="right")
        table.add_column("redeliveries", justify="right")
        table.add_column("acked", justify="right")
        table.add_column("ends as")
        subscribed = {
            "alice": f"{ORDERS_TOPIC} · group {GROUP}", "bob": f"{ORDERS_TOPIC} · group {GROUP}",
            "carol": f"{ORDERS_TOPIC} · group {GROUP} · LOCK {CAROL_LOCK_MS}",
            "A": f"{CHAT_TOPIC}[{CHAT_LMQ}] · exclusive", "B": f"{CHAT_TOPIC}[{CHAT_LMQ}] · exclusive",
        }
        for actor in self.actors:
            if actor.name not in subscribed:
                continue
            redeliveries = sum(1 for d in actor.received if int(d["deliveries"]) > 1)
            style = "red" if "fenced" in actor.ends_as else "yellow" if "suspected" in actor.ends_as else "green"
            table.add_row(Text(actor.name, style=actor.style), Text(subscribed[actor.name]), str(len(actor.received)),
                          str(redeliveries), str(actor.acked), Text(actor.ends_as, style=style))
        self.console.print(table)
        ok = sum(1 for _, good in self.checks if good)
        verdict = (Text(f"{ok}/{len(self.checks)} checks passed", style="bold green") if ok == len(self.checks)
                   else Text(f"{len(self.checks) - ok} of {len(self.checks)} checks FAILED", style="bold red"))
        self.console.print(verdict + Text(f"  in {time.monotonic() - self.t0:.1f} s", style="dim"))


def show_status(console: Console, redis_url: str) -> None:
    """What `fencemq status` reads from Redis right now (before the demo's clients leave)."""
    from fencemq.cli import status
    from fencemq.cli.common import connect

    client = connect(redis_url)
    try:
        snap = status.collect(client)
    finally:
        client.close()
    console.print()
    console.print(Text("What `fencemq status` reads from Redis now:", style="bold"))
    names = {ORDERS_TOPIC, f"{CHAT_TOPIC}[{CHAT_LMQ}]"}
    snap["queues"] = [q for q in snap["queues"] if q["name"] in names]
    status.render_queues(console, snap)
    status.render_groups(console, snap)


def run(console: Console, redis_url: str, source: str) -> bool:
    """Start a worker on ``redis_url`` (already reachable), play the demo, stop the worker."""
    from fencemq.config import Config
    from fencemq.server.runner import WorkerThread

    with WorkerThread(Config(redis_url=redis_url, port=0, mqtt_port=0, mqtt_ws_port=0)) as worker, \
            demo_dashboard(redis_url) as dashboard:
        console.print(Panel.fit(
            Text.assemble(
                ("FenceMQ demo\n", "bold"),
                f"Redis:  {source}\n",
                f"Worker: {worker.worker.id} listening on 127.0.0.1:{worker.port}\n",
                f"MQTT:   127.0.0.1:{worker.worker.mqtt_port} (3.1.1 and 5.0), "
                f"over WebSocket 127.0.0.1:{worker.worker.mqtt_ws_port}\n",
                f"Dashboard: {dashboard.url} (the web UI, `fencemq dashboard`)\n",
                ("Every RESP client below is plain redis-py: any Redis client can talk to a worker.", "dim"),
            )
        ))
        demo = Demo(console, worker.port, mqtt_port=worker.worker.mqtt_port)
        try:
            ok = demo.run()
            show_status(console, redis_url)
        finally:
            demo.close()
        if sys.stdin.isatty():  # someone at a terminal may want to look before it all goes away
            console.print(Text(f"The dashboard is at {dashboard.url}: press Enter to stop.", style="bold"))
            with contextlib.suppress(EOFError, KeyboardInterrupt):
                input()
        console.print(Text("Stopping the worker…", style="dim"))
    return ok


@contextlib.contextmanager
def demo_dashboard(redis_url: str) -> Iterator[Any]:
    """The web UI over the demo's Redis, on 7380 (`fencemq dashboard`'s port) or a free one when taken."""
    from fencemq.ui.pages import UI
    from fencemq.ui.serving import DashboardThread

    try:
        dashboard = DashboardThread(UI(redis_url, interval=0.5), port=7380).start()
    except RuntimeError:
        dashboard = DashboardThread(UI(redis_url, interval=0.5), port=0).start()
    try:
        yield dashboard
    finally:
        dashboard.stop()
