"""The bounded admission of connections in their connect phase (server/admission.py)."""

from __future__ import annotations

from typing import Any

from fencemq.server.admission import Admission


class Door:
    """Connections offered to an admission: which were started (with their done), which abandoned."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.started: dict[int, Any] = {}
        self.abandoned: list[int] = []

    def offer(self, n: int) -> None:
        self.admission.admit(lambda done: self.started.__setitem__(n, done), lambda: self.abandoned.append(n))


def test_connections_past_the_limit_wait_and_are_admitted_first_come_first_served() -> None:
    door = Door(Admission(2))
    for n in range(5):
        door.offer(n)
    assert list(door.started) == [0, 1], "two at once"
    assert door.admission.most_waiting == 3
    door.started[1]()
    assert list(door.started) == [0, 1, 2], "a place given back admits the oldest waiting"
    door.started[0]()
    door.started[2]()
    assert list(door.started) == [0, 1, 2, 3, 4]
    assert door.admission.admitted == 2


def test_a_place_given_back_twice_counts_once() -> None:
    door = Door(Admission(1))
    for n in range(3):
        door.offer(n)
    door.started[0]()
    door.started[0]()  # (its CONNECT answered, then its end: both give the place back)
    assert list(door.started) == [0, 1], "the second call admitted no one more"
    assert door.admission.admitted == 1


def test_a_newcomer_does_not_pass_those_already_waiting() -> None:
    admission = Admission(1)
    order: list[int] = []
    dones: list[Any] = []

    def start(n: int) -> Any:
        def started(done: Any) -> None:
            order.append(n)
            dones.append(done)
        return started

    admission.admit(start(0), lambda: None)
    admission.admit(start(1), lambda: None)
    dones[0]()  # 1 is admitted in the same step: 2, arriving after, waits behind it
    admission.admit(start(2), lambda: None)
    assert order == [0, 1]


def test_those_still_waiting_when_accepting_stops_are_abandoned_not_admitted() -> None:
    door = Door(Admission(1))
    for n in range(4):
        door.offer(n)
    assert door.admission.abandon_waiting() == 3
    assert door.abandoned == [1, 2, 3]
    door.started[0]()
    assert list(door.started) == [0], "nobody is left to admit"


def test_a_start_that_fails_gives_its_place_back() -> None:
    admission = Admission(1)

    def failing(done: Any) -> None:
        raise OSError("the socket is gone")

    try:
        admission.admit(failing, lambda: None)
    except OSError:
        pass
    assert admission.admitted == 0


def test_no_limit_admits_everyone_at_once() -> None:
    door = Door(Admission(0))
    for n in range(1000):
        door.offer(n)
    assert len(door.started) == 1000 and door.admission.most_waiting == 0


def test_a_crowd_leaves_the_listen_backlog_while_the_event_loop_is_busy() -> None:
    """MQTT's door accepts in a thread of its own (accepting.serve_sockets_threaded): a crowd of connects
    completes while the loop is held up (a storm's ends), where a loop that accepts once a turn would
    leave the kernel's backlog full and the clients' SYNs dropped."""
    import socket
    import threading

    import anyio
    from anyio.abc import SocketAttribute

    from fencemq.server.accepting import SpareDescriptor, serve_sockets, shedding

    crowd_size = 50
    handed: list[socket.socket] = []
    opened: list[socket.socket] = []
    failures: list[OSError] = []
    all_in = threading.Event()

    async def main() -> bool:
        listener = shedding(await anyio.create_tcp_listener(local_host="127.0.0.1", backlog=4), SpareDescriptor())
        port = listener.extra(SocketAttribute.local_port)

        async def handler(sock: socket.socket, address: Any) -> None:
            handed.append(sock)

        def crowd() -> None:
            for _ in range(crowd_size):
                try:
                    opened.append(socket.create_connection(("127.0.0.1", port), timeout=15))
                except OSError as exc:
                    failures.append(exc)
            all_in.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: serve_sockets(listener, handler, threaded=True))
            await anyio.sleep(0.2)
            threading.Thread(target=crowd, daemon=True).start()
            # the loop is busy: nothing of it runs until the whole crowd is connected (or 10 s)
            in_while_busy = all_in.wait(10)
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
        await listener.aclose()
        return in_while_busy

    try:
        assert anyio.run(main), "the crowd connected while the loop was busy"
        assert failures == [] and len(opened) == crowd_size
        assert len(handed) == crowd_size, "each accepted socket was handed to the door once the loop ran"
    finally:
        for s in opened + handed:
            s.close()



def test_a_door_that_waits_in_a_task_is_admitted_in_turn_and_a_cancelled_wait_holds_no_turn() -> None:
    import anyio

    async def scenario() -> None:
        admission = Admission(1)
        first = await admission.place()  # a place is free: at once
        assert first is not None and admission.admitted == 1
        got: dict[str, Any] = {}

        async def wait(name: str) -> None:
            got[name] = await admission.place()

        async with anyio.create_task_group() as tg:
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(wait, "cancelled")
                await anyio.sleep(0.01)
                doomed.cancel_scope.cancel()  # its connection's task is cancelled while it waits
            tg.start_soon(wait, "next")
            await anyio.sleep(0.01)
            assert got == {} and admission.admitted == 1
            first()  # the cancelled wait is passed over: the next in line is admitted
            await anyio.sleep(0.01)
            assert "cancelled" not in got and got["next"] is not None and admission.admitted == 1
            got["next"]()
        assert admission.admitted == 0 and not admission.waiting
        assert await admission.place() is not None, "a newcomer is admitted at once"

    anyio.run(scenario)


def test_a_door_waiting_in_a_task_when_accepting_stops_is_told_so_and_never_admitted() -> None:
    import anyio

    async def scenario() -> None:
        admission = Admission(1)
        first = await admission.place()
        got: dict[str, Any] = {}

        async def wait() -> None:
            got["waiting"] = await admission.place()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await anyio.sleep(0.01)
            assert admission.abandon_waiting() == 1
        assert got["waiting"] is None
        first()
        assert admission.admitted == 0

    anyio.run(scenario)
