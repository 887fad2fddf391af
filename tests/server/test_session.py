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
from fencemq.model.keys import Handle, QueueRef
from fencemq.protocol.commands import TABLE
from fencemq.protocol.resp import Push
from fencemq.server.handles import HandleSigner
from fencemq.server.roster import Roster
from fencemq.server.session import Session
from fencemq.server.verbs import Verbs


class StandIns:
    """What a connection lends its session, recording what the session does with it."""

    def __init__(self) -> None:
        self.hangup = anyio.Event()
        self.watching = False
        self.ended = 0

    async def watch_for_hangup(self, scope: anyio.CancelScope) -> None:
        self.watching = True
        try:
            await self.hangup.wait()
            self.session.closing = True
            scope.cancel()
        finally:
            self.watching = False

    def end_connection(self) -> None:
        self.ended += 1


SIGNER = HandleSigner(b"a test secret")


def session_with(config: Config | None = None) -> tuple[Session, StandIns]:
    lent = StandIns()
    services = SimpleNamespace(config=config or Config(), roster=Roster(), handles=SIGNER)
    lent.session = Session(services, "w1:7", watch_for_hangup=lent.watch_for_hangup,  # type: ignore[arg-type]
                           end_connection=lent.end_connection)
    return lent.session, lent


def test_a_wait_is_cut_short_when_the_connection_sees_the_client_hang_up():
    async def main() -> None:
        session, lent = session_with()
        waited = False
        with anyio.fail_after(5):
            async with session.until_hangup():
                await anyio.sleep(0.01)
                lent.hangup.set()
                await anyio.sleep(10)
                waited = True
        assert session.closing and not waited and not lent.watching

    anyio.run(main)


def test_a_wait_that_ends_by_itself_stops_the_watch_and_leaves_the_connection_open():
    async def main() -> None:
        session, lent = session_with()
        with anyio.fail_after(5):
            async with session.until_hangup():
                await anyio.sleep(0.01)
                assert lent.watching
        assert not lent.watching and not session.closing

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


def test_a_notice_is_pushed_to_a_resp3_client_only():
    session, _ = session_with()
    notice = {"type": "evicted", "handle": "h"}
    session._on_message(msgpack.packb(notice))
    with pytest.raises(anyio.WouldBlock):
        session.outbox.receive_nowait()
    session.proto = 3
    session._on_message(msgpack.packb(notice))
    assert session.outbox.receive_nowait() == Push(["notice", {**notice, "handle": SIGNER.sign("h")}])


def test_a_session_starts_authenticated_only_when_the_worker_has_no_password():
    assert session_with()[0].authed
    assert not session_with(Config(password="s3cret"))[0].authed


def test_every_verb_of_the_command_table_has_a_handler_that_takes_the_session_first():
    verbs = Verbs(SimpleNamespace(config=Config()))  # type: ignore[arg-type]
    assert set(verbs.handlers) == set(TABLE)
    for verb, handler in verbs.handlers.items():
        assert inspect.iscoroutinefunction(handler), verb
        assert next(iter(inspect.signature(handler).parameters)) == "session", verb
