"""``fencemq user add|passwd|del|list|grant|revoke``: the broker's users and what they may do.

Users live in the broker's Redis (fencemq.ops.users), so every worker sees a change at
the next AUTH. Passwords are read from a hidden prompt, or from standard input with
--password-stdin (one line), never from the command line (it would sit in the shell history
and in `ps`). Options, exit codes and output conventions as in cli/ops.py.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from fencemq.cli.opskit import (
    EXIT_USAGE, Cluster, Ctx, Json, Prefix, RedisUrl, Yes, _confirm, _emit_json, _out, _row, _table,
)
from fencemq.errors import BadArgument
from fencemq.model.topics import check_filter
from fencemq.ops.users import ACTIONS, ALL, UserStore, check_action, check_password, check_user_name

user_app = typer.Typer(help="Users and their permissions (stored in the broker's Redis).", no_args_is_help=True)

Name = Annotated[str, typer.Argument(help="The user name (letters, digits, . _ @ -).")]
Action = Annotated[str, typer.Argument(help=f"One of {', '.join((*ACTIONS, ALL))}.")]
Filter = Annotated[str, typer.Argument(help="An MQTT-style topic filter: orders/+, sensors/#, # for all.")]
PasswordStdin = Annotated[bool, typer.Option("--password-stdin", help="Read the password from standard input.")]


PROMPT_TRIES = 3


def _password(ctx: Ctx, from_stdin: bool, name: str) -> str:
    """The new password: one line of standard input with --password-stdin, else asked on the terminal
    (checked as soon as it is typed, then asked again to confirm). Without a terminal and without
    --password-stdin, a one-line error saying how to give it (exit 2), never a prompt nobody sees."""
    if from_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
        try:
            return check_password(password)
        except BadArgument as exc:
            ctx.fail(exc.message, EXIT_USAGE)
    if not sys.stdin.isatty():
        ctx.fail("no terminal to ask the password on: give it on standard input with --password-stdin, e.g. "
                 f"printf '%s\\n' \"$PASSWORD\" | fencemq {ctx.command} {name} --password-stdin", EXIT_USAGE)
    for _ in range(PROMPT_TRIES):
        password = typer.prompt("Password", hide_input=True, err=True)
        try:
            check_password(password)
            break
        except BadArgument as exc:
            typer.echo(f"{exc.message}; try again", err=True)
    else:
        ctx.fail(f"no acceptable password in {PROMPT_TRIES} tries; nothing changed", EXIT_USAGE)
    if typer.prompt("Repeat the password", hide_input=True, err=True) != password:
        ctx.fail("the two passwords differ; nothing changed", EXIT_USAGE)
    return password


def _store(ctx: Ctx, r) -> UserStore:
    return UserStore(r, ctx.keys.users)


@user_app.command("add")
def user_add(name: Name, password_stdin: PasswordStdin = False,
             grant: Annotated[list[str] | None, typer.Option("--grant", metavar="ACTION:FILTER", help="What the user may do on which topics, e.g. publish:orders/# (repeatable).")] = None,
             redis_url: RedisUrl = None, prefix: Prefix = None, cluster: Cluster = False) -> None:
    """Add a user (no permissions unless --grant)."""
    ctx = Ctx("user add", redis_url, prefix, cluster)
    grants = []
    try:  # what can be checked is checked before the password is asked for
        check_user_name(name)
        for g in grant or []:
            action, _, filt = g.partition(":")
            grants.append((check_action(action), check_filter(filt or "#")))
    except BadArgument as exc:
        ctx.fail(exc.message, EXIT_USAGE)
    if ctx.run(lambda r, _k: _store(ctx, r).exists(name)):
        ctx.fail(f"user '{name}' exists; use passwd or grant", EXIT_USAGE)
    password = _password(ctx, password_stdin, name)
    ctx.run(lambda r, _k: _store(ctx, r).add(name, password, grants), writes=True)
    _out().print(f"user {name} added")


@user_app.command("passwd")
def user_passwd(name: Name, password_stdin: PasswordStdin = False, redis_url: RedisUrl = None, prefix: Prefix = None,
                cluster: Cluster = False) -> None:
    """Set a user's password."""
    ctx = Ctx("user passwd", redis_url, prefix, cluster)
    try:
        check_user_name(name)
    except BadArgument as exc:
        ctx.fail(exc.message, EXIT_USAGE)
    if not ctx.run(lambda r, _k: _store(ctx, r).exists(name)):
        ctx.fail(f"no user '{name}'", EXIT_USAGE)
    password = _password(ctx, password_stdin, name)
    ctx.run(lambda r, _k: _store(ctx, r).passwd(name, password), writes=True)
    _out().print(f"password of {name} changed")


@user_app.command("del")
def user_del(name: Name, yes: Yes = False, redis_url: RedisUrl = None, prefix: Prefix = None,
             cluster: Cluster = False) -> None:
    """Delete a user (its sessions keep running until they reconnect). Asks first unless --yes."""
    ctx = Ctx("user", redis_url, prefix, cluster)
    _confirm(ctx, yes, f"Delete user {name}?", f"delete user {name}")
    if not ctx.run(lambda r, _k: _store(ctx, r).delete(name), writes=True):
        ctx.fail(f"no user {name!r}", 1)
    _out().print(f"user {name} deleted")


@user_app.command("grant")
def user_grant(name: Name, action: Action, filt: Filter, redis_url: RedisUrl = None, prefix: Prefix = None,
               cluster: Cluster = False) -> None:
    """Let a user do ACTION on the topics FILTER matches."""
    ctx = Ctx("user", redis_url, prefix, cluster)
    ctx.run(lambda r, _k: _store(ctx, r).grant(name, action, filt), writes=True)
    _out().print(f"{name} may {action} on {filt}")


@user_app.command("revoke")
def user_revoke(name: Name, action: Action, filt: Filter, redis_url: RedisUrl = None, prefix: Prefix = None,
                cluster: Cluster = False) -> None:
    """Take back a grant (the same ACTION and FILTER it was given with)."""
    ctx = Ctx("user", redis_url, prefix, cluster)
    ctx.run(lambda r, _k: _store(ctx, r).revoke(name, action, filt), writes=True)
    _out().print(f"{name} may no longer {action} on {filt}")


@user_app.command("list")
def user_list(redis_url: RedisUrl = None, prefix: Prefix = None, cluster: Cluster = False,
              as_json: Json = False) -> None:
    """Every user and its grants."""
    ctx = Ctx("user", redis_url, prefix, cluster)
    users = ctx.run(lambda r, _k: _store(ctx, r).list())
    if as_json:
        _emit_json([{"name": u.name, "grants": [list(g) for g in u.grants]} for u in users])
        return
    t = _table(f"Users ({len(users)})")
    t.add_column("user")
    t.add_column("grants", overflow="fold")
    for u in users:
        _row(t, u.name, ", ".join(f"{a} {f}" for a, f in u.grants) or "(none)")
    _out().print(t)
