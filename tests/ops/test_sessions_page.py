"""The sessions the operator pages through (the web UI's sessions page) name the user behind each."""

from __future__ import annotations

import asyncio

import pytest

from fencemq.model.keys import Keyspace
from fencemq.ops.overview import sessions_page
from fencemq.ops.users import UserStore
from tests.helpers import RespConn, direct_async, worker

pytestmark = pytest.mark.standalone


def test_a_session_shows_the_user_that_owns_its_client_id(redis_url: str) -> None:
    keys = Keyspace()

    async def add_user() -> None:
        r = direct_async(redis_url)
        await UserStore(r, keys.users).add("svc", "service secret", [("subscribe", "#")])
        await r.aclose()

    async def page() -> dict:
        r = direct_async(redis_url)
        try:
            return await sessions_page(r, keys, match="svc-")
        finally:
            await r.aclose()

    asyncio.run(add_user())
    with worker(redis_url, users=True) as w:
        c = RespConn(w.port)
        assert c.call("AUTH", "svc", "service secret") == "OK"
        assert c.call("CLIENT", "SETNAME", "svc-1") == "OK"
        c.call("SUB", "t", "GROUP", "g")
        sessions = asyncio.run(page())["sessions"]
        assert [(s["client"], s["user"], s["subscriptions"]) for s in sessions] == [("svc-1", "svc", 1)]
        c.close()
