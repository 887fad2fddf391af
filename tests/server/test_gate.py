"""The gate's own rules, beside the rule-by-door table (test_gate_doors.py): the one matcher, the
bound on password hashes, the passes it counts."""

from __future__ import annotations

import time

import anyio
import pytest

from fencemq.config import Config
from fencemq.errors import LimitExceeded, WrongPassword
from fencemq.ops.users import User, default_user
from fencemq.server.gate import Gate, still_covers


class SlowUsers:
    """A user store whose password check takes 0.1 s and counts how many run at once (the gate's
    bound is what is under test, not scrypt)."""

    def __init__(self) -> None:
        self.redis = None
        self.running = self.most = 0

    async def authenticate(self, name: str, password: str) -> User | None:
        self.running += 1
        self.most = max(self.most, self.running)
        await anyio.sleep(0.1)
        self.running -= 1
        return User(name, (("all", "#"),), credential="c") if password == "right" else None

    async def any(self) -> bool:
        return True


def gate(**settings: object) -> tuple[Gate, SlowUsers]:
    users = SlowUsers()
    return Gate(Config(users=True, auth_delay_ms=1, auth_delay_max_ms=1, **settings), users), users  # type: ignore


@pytest.mark.parametrize(("grant", "target", "allowed"), [
    ("orders/+", "orders/eu", True),
    ("orders/+", "orders/#", False),  # a filter is covered whole, or not at all
    ("orders/#", "orders/+", True),
    ("#", "$SYS/x", False),  # a leading wildcard never reaches a $-topic, for publish as for subscribe
    ("+/x", "$SYS/x", False),
    ("$SYS/#", "$SYS/x", True),
    ("#", "#", True),  # "any topic": only a grant on every topic
    ("orders/#", "#", False),
])
def test_one_matcher_decides_every_action_on_topics_and_filters(grant: str, target: str, allowed: bool) -> None:
    for action in ("publish", "subscribe", "purge"):
        assert User("u", ((action, grant),)).may(action, target) is allowed
        assert Gate.allows(User("u", ((action, grant),)), action, target) is allowed
    assert default_user().may("publish", "$SYS/x"), "the legacy password's default user may do anything"


def test_at_most_max_password_checks_hash_at_once_from_many_addresses() -> None:
    g, users = gate(max_password_checks=2)

    async def main() -> None:
        async def one(n: int) -> None:
            with pytest.raises(WrongPassword):
                await g.log_in(g.enter("resp", f"10.0.0.{n}"), "u", b"wrong")

        async with anyio.create_task_group() as tg:
            for n in range(10):
                tg.start_soon(one, n)

    anyio.run(main)
    assert users.most == 2


def test_the_checks_of_one_address_run_one_at_a_time() -> None:
    g, users = gate(max_password_checks=8)

    async def main() -> float:
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(g.log_in, g.enter("mqtt", "10.0.0.1"), "u", b"right")
        return time.monotonic() - started

    took = anyio.run(main)
    assert users.most == 1 and took >= 0.4


def test_connections_are_counted_per_worker_and_per_user_whatever_the_door() -> None:
    g, _ = gate(max_connections=3, max_connections_per_user=2)
    alice = User("alice", (("all", "#"),))
    a, b = g.enter("resp", "h"), g.enter("mqtt", "h")
    g.admit(a, alice)
    g.admit(b, alice)
    c = g.enter("ui", "h")
    with pytest.raises(LimitExceeded):
        g.enter("mqtt-ws", "h")  # the fourth connection of the worker
    with pytest.raises(LimitExceeded):
        g.admit(c, alice)  # alice's third
    assert c.user is None
    g.leave(a)
    g.admit(c, alice)  # one of hers went: the door lets another in
    assert g.held_by("alice") == 2 and g.connections == 2


def test_a_changed_record_goes_on_in_place_only_when_it_takes_nothing_away() -> None:
    before = User("u", (("publish", "a/#"),), credential="c1")
    assert still_covers(User("u", (("publish", "a/#"), ("subscribe", "b")), credential="c1"), before)
    assert not still_covers(User("u", (("subscribe", "b"),), credential="c1"), before)  # a grant revoked
    assert not still_covers(User("u", (("publish", "a/#"),), credential="c2"), before)  # a new password
