"""`fencemq user …`: an operator manages users from the command line; a worker honours them at once."""

from __future__ import annotations

from tests.cli.test_cli_ops import invoke
from tests.helpers import RespConn, worker


def test_an_operator_adds_a_user_grants_it_a_topic_and_the_worker_honours_it(redis_url) -> None:
    url = ["--redis-url", redis_url]
    assert invoke("user", "add", "svc", "--password-stdin", *url, input="service secret\n").exit_code == 0
    assert invoke("user", "grant", "svc", "publish", "orders/#", *url).exit_code == 0
    listed = invoke("user", "list", "--json", *url)
    assert '"svc"' in listed.stdout and '"orders/#"' in listed.stdout
    with worker(redis_url, users=True) as w:
        c = RespConn(w.port)
        assert c.call("AUTH", "svc", "service secret") == "OK"
        assert c.call("PUB", "orders/eu", "x") == "1"
        assert invoke("user", "revoke", "svc", "publish", "orders/#", *url).exit_code == 0
        d = RespConn(w.port)
        d.call("AUTH", "svc", "service secret")
        assert d.call("PUB", "orders/eu", "x").code == "NOPERM"


def test_bad_input_exits_2_with_a_clear_message_and_adds_nobody(redis_url) -> None:
    url = ["--redis-url", redis_url]
    short = invoke("user", "add", "svc", "--password-stdin", *url, input="short\n")
    assert short.exit_code == 2 and "8 to 1024" in short.output
    bad = invoke("user", "add", "a b", "--password-stdin", *url, input="long enough\n")
    assert bad.exit_code == 2 and "user name" in bad.output
    assert invoke("user", "list", "--json", *url).stdout.strip() == "[]"


def test_deleting_a_user_asks_first_and_needs_yes_without_a_terminal(redis_url) -> None:
    url = ["--redis-url", redis_url]
    invoke("user", "add", "gone", "--password-stdin", *url, input="long enough\n")
    assert invoke("user", "del", "gone", *url).exit_code == 2
    assert invoke("user", "del", "gone", "--yes", *url).exit_code == 0
    assert invoke("user", "del", "gone", "--yes", *url).exit_code == 1
