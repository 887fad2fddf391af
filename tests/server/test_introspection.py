"""What a worker says about itself to Redis tooling: INFO, CLIENT, COMMAND, ECHO, RESET.

Health probes, ``redis-cli --stat`` and client libraries' ready checks ask
these first; each test holds a worker's answer against what the tool reads,
and where the shape matters against a real Redis's own answer.
"""

from __future__ import annotations

import shutil

import pytest
import redis

from fencemq.protocol.commands import COMMANDS
from tests.helpers import RespConn, Terminal, as_map, client, error_code, text, worker

needs_redis_cli = pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not on PATH")


def test_info_answers_the_sections_a_ready_check_reads_and_says_it_is_not_loading(redis_url):
    with worker(redis_url) as w:
        info = redis.Redis(port=w.port).info()  # redis-py's own parser
        assert info["loading"] == 0
        assert info["redis_version"].startswith("7.") and info["fencemq_version"]
        assert info["connected_clients"] >= 1 and info["tcp_port"] == w.port
        assert info["total_commands_processed"] >= 1 and info["role"] == "master"


def test_info_with_a_section_answers_that_section_only_and_ignores_one_it_does_not_know(redis_url):
    with worker(redis_url) as w, RespConn(w.port) as c:
        assert text(c.call("INFO", "persistence")).splitlines()[:2] == ["# Persistence", "loading:0"]
        assert "# Server" not in text(c.call("INFO", "persistence"))
        assert text(c.call("INFO", "no-such-section")) == ""


def test_client_info_describes_this_connection_as_redis_does(redis_url):
    with worker(redis_url) as w:
        r = redis.Redis(port=w.port, client_name="billing", protocol=3)
        me = r.client_info()
        assert me["name"] == "billing" and str(me["resp"]) == "3" and int(me["db"]) == 0
        assert int(me["id"]) == r.client_id()
        assert me["lib-name"] == "redis-py"  # from the CLIENT SETINFO redis-py sends on connect
        assert r.client_getname() == b"billing"


def test_client_list_shows_the_connections_of_its_own_session_and_never_another_clients(redis_url):
    with worker(redis_url) as w:
        mine = [client(w.port, 2, "alice"), client(w.port, 2, "alice")]
        other = client(w.port, 2, "bob")
        listed = text(mine[0].execute_command("CLIENT", "LIST")).splitlines()
        assert len(listed) == 2 and all(" name=alice " in line for line in listed)
        (bobs,) = text(other.execute_command("CLIENT", "LIST")).splitlines()
        assert " name=bob " in bobs and "alice" not in bobs


def test_a_client_subcommand_it_does_not_know_is_refused_and_changes_nothing(redis_url):
    with worker(redis_url) as w:
        c = client(w.port, 2, "alice")
        with pytest.raises(redis.ResponseError) as err:
            c.execute_command("CLIENT", "KILL", "ID", "1")
        assert error_code(err.value) == "BADARG" and "TAKEOVER" in str(err.value)
        assert text(c.execute_command("CLIENT", "GETNAME")) == "alice"


def test_command_count_and_info_describe_every_verb_of_the_command_table(redis_url, redis_server):
    with worker(redis_url) as w, RespConn(w.port) as c:
        assert c.call("COMMAND", "COUNT") == len(COMMANDS)
        pub, missing = c.call("COMMAND", "INFO", "pub", "nosuchverb")
        assert missing is None
        assert pub[:3] == ["pub", -3, ["write"]]
        real = redis.Redis.from_url(redis_server.url)
        real.response_callbacks.clear()
        (get,) = real.execute_command("COMMAND", "INFO", "GET")
        assert len(pub) == len(get)  # the same ten fields Redis 7 gives
        assert [type(x) for x in pub[1:6]] == [type(x) for x in get[1:6]]
        assert {text(row[0]) for row in c.call("COMMAND")} == {v.lower() for v in COMMANDS}


def _argument_keys(args: list) -> set[str]:
    keys: set[str] = set()
    for arg in args:
        arg = as_map(arg)
        keys |= set(arg)
        keys |= _argument_keys(arg.get("arguments", []))
    return keys


def test_command_docs_answer_in_redis_7_shape_with_the_arguments_of_each_verb(redis_url, redis_server):
    with worker(redis_url) as w, RespConn(w.port) as c:
        docs = as_map(c.call("COMMAND", "DOCS", "PULL", "SEEK", "nosuchverb"))
        assert set(docs) == {"pull", "seek"}
        pull = as_map(docs["pull"])
        assert pull["summary"] and pull["group"] == "fencemq"
        args = [as_map(a) for a in pull["arguments"]]
        assert [(a["name"], a["type"], a.get("token")) for a in args] == [
            ("handle", "string", None), ("count", "integer", "COUNT"), ("ms", "integer", "BLOCK")]
        assert args[1]["flags"] == ["optional"]
        real = redis.Redis.from_url(redis_server.url)
        real.response_callbacks.clear()
        redis_docs = as_map(text(real.execute_command("COMMAND", "DOCS", "SET")))
        redis_set = as_map(redis_docs["set"])
        assert set(pull) <= set(redis_set) | {"complexity"}
        assert _argument_keys(pull["arguments"]) <= _argument_keys(redis_set["arguments"]) | {"flags"}


@needs_redis_cli
def test_redis_cli_hints_a_verbs_arguments_as_it_is_typed(redis_url):
    with worker(redis_url) as w, Terminal("redis-cli", "-p", str(w.port)) as term:
        assert term.read_until(b"> "), term.seen
        term.type(b"PULL ")
        assert term.read_until(b"[COUNT count]"), f"no hint in {term.seen!r}"
        assert b"handle [COUNT count] [BLOCK ms]" in term.seen


@needs_redis_cli
def test_redis_cli_stat_reads_the_workers_figures(redis_url):
    with worker(redis_url) as w, Terminal("redis-cli", "-p", str(w.port), "--stat", "-i", "0.1") as term:
        assert term.read_until(b"clients blocked requests"), term.seen  # its header
        # each sample is an INFO: the worker's count of requests grows by one between two
        assert term.read_until(b"(+1)"), term.seen
        sample = next(line for line in term.seen.decode().splitlines() if "(+1)" in line).split()
        assert sample[2:4] == ["1", "0"], sample  # one client, none blocked


def test_echo_answers_its_message(redis_url):
    with worker(redis_url) as w:
        assert redis.Redis(port=w.port).echo(b"\x00bytes\xff") == b"\x00bytes\xff"


def test_reset_makes_the_connection_new_and_leaves_its_named_session_to_the_others(redis_url):
    with worker(redis_url) as w:
        c = RespConn(w.port)
        c.hello(3, "alice")
        other = client(w.port, 2, "alice")
        h = as_map(c.call("SUB", "orders", "GROUP", "g"))["handle"]
        c.call("MULTI")
        assert c.call("RESET") == "RESET"
        assert c.call("CLIENT", "GETNAME") is None  # anonymous again
        assert c.call("EXEC").code == "ERR"  # the transaction is gone
        assert isinstance(c.call("PING"), str)
        assert c.call("PULL", h).code == "NOPERM"  # not alice any more
        assert other.execute_command("PULL", h) == []  # alice's session goes on
        c.close()


def test_reset_on_a_worker_with_a_password_asks_for_it_again(redis_url):
    with worker(redis_url, password="s3cret") as w, RespConn(w.port) as c:
        assert c.call("AUTH", "s3cret") == "OK"
        assert c.call("RESET") == "RESET"
        assert c.call("PUB", "orders", "x").code == "NOAUTH"
