"""`fencemq user …`: an operator manages users from the command line; a worker honours them at once."""

from __future__ import annotations

import subprocess
import sys

from tests.cli.test_cli_ops import invoke
from tests.helpers import RespConn, Terminal, wait_for, worker

FENCEMQ = [sys.executable, "-m", "fencemq.cli.main"]


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


def test_without_a_terminal_user_add_says_to_use_password_stdin_and_adds_nobody(redis_url) -> None:
    result = subprocess.run([*FENCEMQ, "user", "add", "svc", "--grant", "publish:orders/#", "--redis-url", redis_url],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "no terminal to ask the password on" in result.stderr and "--password-stdin" in result.stderr
    assert "Warning" not in result.stderr and "Aborted" not in result.stderr, result.stderr
    assert invoke("user", "list", "--json", "--redis-url", redis_url).stdout.strip() == "[]"


def test_on_a_terminal_a_too_short_password_is_refused_before_it_is_asked_again(redis_url) -> None:
    with Terminal(*FENCEMQ, "user", "add", "svc", "--redis-url", redis_url) as term:
        assert term.read_until(b"Password:"), term.seen
        term.type_hidden(b"short\r")
        assert term.read_until(b"8 to 1024 characters; try again"), term.seen
        assert b"Repeat" not in term.seen
        wait_for(lambda: term.read_until(b"\0never\0", 0.05) or term.seen.count(b"Password:") == 2,
                 what=f"the password asked again: {term.seen!r}")
        term.type_hidden(b"long enough\r")
        assert term.read_until(b"Repeat the password:"), term.seen
        term.type_hidden(b"long enough\r")
        assert term.exit_code() == 0, term.seen
        assert b"user svc added" in term.seen
    with worker(redis_url, users=True) as w:
        assert RespConn(w.port).call("AUTH", "svc", "long enough") == "OK"


def test_what_can_be_checked_is_checked_before_the_password_is_asked_for(redis_url) -> None:
    url = ["--redis-url", redis_url]
    invoke("user", "add", "svc", "--password-stdin", *url, input="long enough\n")
    for args, why in ((["svc"], "user 'svc' exists"), (["new", "--grant", "pub:x"], "unknown action 'pub'"),
                      (["new", "--grant", "publish:a/#/b"], "")):
        result = subprocess.run([*FENCEMQ, "user", "add", *args, *url], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and why in result.stderr, result.stderr
        assert "terminal" not in result.stderr, f"{args}: asked for a password first: {result.stderr}"
