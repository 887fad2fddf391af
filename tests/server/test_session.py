"""The session a verb acts for, and the verbs' table, without a socket or a Redis.

The connection lends a session its hang-up watch and a way to end the
connection; here both are stand-ins, so what the session does with them is
all that is under test.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import anyio
import msgpack
import pytest

from fencemq.config import Config
from fencemq.errors import NoPermission
from fencemq.model.keys import QueueRef
from fencemq.model.handles import Handle
from fencemq.protocol.commands import TABLE
from fencemq.protocol.resp import Push
from fencemq.server.handles import HandleSigner
from fencemq.server.roster import Roster
from fencemq.server.session import Session
from fencemq.server.verbs import Verbs


class StandIns:
    """What a connection lends its session, recording what the session does with it."""

    def __init__(self) -> None:
        self.watched: anyio.CancelScope | None = None  # the wait a hang-up would cancel now
        self.ended = 0
        self.pushed: list[Push] = []
        self.room = True  # whether the client has room for a push

    def watch_for_hangup(self, scope: anyio.CancelScope | None) -> None:
        self.watched = scope

    def hang_up(self) -> None:
        """The client goes away: as the connection does, the session is closing and its wait cancelled."""
        self.session.closing = True
        if self.watched is not None:
            self.watched.cancel()

    def end_connection(self) -> None:
        self.ended += 1

    def push(self, frame: Push) -> bool:
        if self.room:
            self.pushed.append(frame)
        return self.room


SIGNER = HandleSigner(b"a test secret")


def session_with(config: Config | None = None) -> tuple[Session, StandIns]:
    lent = StandIns()
    services = SimpleNamespace(config=config or Config(), roster=Roster(), handles=SIGNER)
    lent.session = Session(services, "w1:7", watch_for_hangup=lent.watch_for_hangup,  # type: ignore[arg-type]
                           end_connection=lent.end_connection, push=lent.push)
    return lent.session, lent


def test_a_wait_is_cut_short_when_the_connection_sees_the_client_hang_up():
    async def main() -> None:
        session, lent = session_with()
        waited = False
        with anyio.fail_after(5):
            async with session.until_hangup():
                await anyio.sleep(0.01)
                lent.hang_up()
                await anyio.sleep(10)
                waited = True
        assert session.closing and not waited and lent.watched is None

    anyio.run(main)


def test_a_wait_that_ends_by_itself_stops_the_watch_and_leaves_the_connection_open():
    async def main() -> None:
        session, lent = session_with()
        with anyio.fail_after(5):
            async with session.until_hangup():
                await anyio.sleep(0.01)
                assert lent.watched is not None and session.waiting
        assert lent.watched is None and not session.closing and not session.waiting

    anyio.run(main)


def test_a_verbs_own_error_during_a_wait_reaches_it_as_itself():
    async def main() -> None:
        session, lent = session_with()
        with pytest.raises(NoPermission):
            async with session.until_hangup():
                raise NoPermission("the member left")
        assert lent.watched is None

    anyio.run(main)


def test_a_handle_is_the_sessions_only_when_its_member_is_the_sessions_client():
    session, _ = session_with()
    session.client_id = "alice"
    mine = SIGNER.sign(Handle(QueueRef("orders"), "g", "alice").encode())
    theirs = SIGNER.sign(Handle(QueueRef("orders"), "g", "bob").encode())
    assert session.own(mine).member == "alice"
    with pytest.raises(NoPermission):
        session.own(theirs)


def test_a_handle_the_broker_did_not_sign_is_refused_even_when_it_names_the_sessions_client():
    session, _ = session_with()
    session.client_id = "alice"
    bare = Handle(QueueRef("orders"), "g", "alice").encode()
    for forged in (bare, bare + ".AAAAAAAAAAAAAAAA", HandleSigner(b"another broker").sign(bare)):
        with pytest.raises(NoPermission, match="not issued by this broker"):
            session.own(forged)
    other_queue = Handle(QueueRef("payroll"), "g", "alice").encode()
    with pytest.raises(NoPermission):  # a MAC moved onto other fields is no MAC of theirs
        session.own(other_queue + "." + SIGNER.sign(bare).split(".")[1])


def test_a_takeover_by_another_connection_ends_this_one_and_gives_up_the_session():
    session, lent = session_with()
    session.client_id, session.bound = "alice", True
    session._on_message(msgpack.packb({"type": "takeover", "conn": "w1:7"}))
    assert (lent.ended, session.bound, session.closing) == (0, True, False), "its own takeover is no news"
    session._on_message(msgpack.packb({"type": "takeover", "conn": "w2:1"}))
    assert (lent.ended, session.bound, session.closing) == (1, False, True)


def test_a_notice_is_pushed_to_a_resp3_client_only_and_one_without_room_waits_for_heartbeat():
    session, lent = session_with()
    notice = {"type": "evicted", "handle": "h"}
    session._on_message(msgpack.packb(notice))
    assert lent.pushed == []
    session.proto = 3
    session._on_message(msgpack.packb(notice))
    assert lent.pushed == [Push(["notice", {**notice, "handle": SIGNER.sign("h")}])]
    lent.room = False
    session._on_message(msgpack.packb(notice))  # never blocks the pub/sub reader
    assert len(lent.pushed) == 1
    assert session.tell({"type": "draining"}) is False


def test_a_session_starts_authenticated_only_when_the_worker_has_no_password():
    assert session_with()[0].authed
    assert not session_with(Config(password="s3cret"))[0].authed


def test_every_verb_of_the_command_table_has_a_handler_that_takes_the_session_first():
    verbs = Verbs(SimpleNamespace(config=Config()))  # type: ignore[arg-type]
    assert set(verbs.handlers) == set(TABLE)
    for verb, handler in verbs.handlers.items():
        assert inspect.iscoroutinefunction(handler), verb
        assert next(iter(inspect.signature(handler).parameters)) == "session", verb
