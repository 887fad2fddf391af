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
