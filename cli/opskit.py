"""What the operator commands share: options, the Redis context, formatting."""


from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import redis
import typer
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from fencemq.errors import BadArgument, FenceMQError, LimitExceeded, NoPermission, NotFound, WrongPassword
from fencemq.model.keys import Keyspace, QueueRef, check_name, check_topic
from fencemq.model.topics import SHARE_PREFIX, has_wildcard, parse_target
from fencemq.cli.common import (
    ENV_REDIS_URL,
    EXIT_UNREACHABLE,
    CliError,
    async_client,
    broker_redis,
    connect,
    fail,
    safe_url,
    unreachable_message,
)

T = TypeVar("T")

EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_DENIED = 0, 1, 2, 4
ENV_PREFIX = "FENCEMQ_PREFIX"
# Once the broker has users, operator commands act as one of them (docs/security.md, "Operators").
ENV_USER, ENV_USER_PASSWORD = "FENCEMQ_USER", "FENCEMQ_USER_PASSWORD"
# The permission (ops/users.py ACTIONS) each operator command needs, on its topic ('#' when it names none).
PERMISSION_OF = {"status": "inspect", "snapshot": "inspect",
                 "inspect": "inspect", "queues": "inspect", "lmqs": "inspect", "top": "inspect", "dlq": "dlq",
                 "evict": "evict", "seek": "seek", "purge": "purge", "sweep": "admin", "user": "admin",
                 "retention": "admin", "scheduled list": "inspect", "scheduled cancel": "purge",
                 "priority set": "admin", "priority show": "inspect"}
ROOT = Path(__file__).resolve().parent.parent

# -- shared options -------------------------------------------------------------------------

RedisUrl = Annotated[str | None, typer.Option(
    "--redis-url", metavar="URL", show_default=False,
    help=f"Redis/Valkey URL, e.g. redis://host:6379/0 (default: ${ENV_REDIS_URL}, else the private Redis "
         "of the one `fencemq serve` running here)")]
Prefix = Annotated[str | None, typer.Option(
    "--prefix", show_default=False, help=f"Key prefix of the broker's state (default: ${ENV_PREFIX} or fmq)")]
Cluster = Annotated[bool, typer.Option(
    "--cluster", help="Talk Redis Cluster (else detected from INFO cluster); every master is visited.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
Topic = Annotated[str, typer.Argument(metavar="TOPIC", help="The topic (the filter, with --owner).", show_default=False)]
Lmq = Annotated[str | None, typer.Option("--lmq", metavar="L", show_default=False,
                                            help="The lite queue (lmq) of a lite topic.")]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (needed without a terminal).")]
Owner = Annotated[str | None, typer.Option(
    "--owner", metavar="O", show_default=False,
    help="A filter subscription's queue: its client (TOPIC is then the filter; a shared group's is TOPIC '$share/<group>/<filter>').")]


class Ctx:
    """What every Redis command resolves first: the URL, the prefix, Cluster or not."""

    def __init__(self, command: str, redis_url: str | None, prefix: str | None, cluster: bool) -> None:
        self.command = command
        self.url, self.prefix = broker_redis(command, redis_url, prefix)
        self.keys = Keyspace(self.prefix)
        self.cluster = cluster
        self.topic = "#"  # what the command acts on, for its permission (set by _queue, or by the command)
        self._authorized = False

    async def authorize(self, client: Any) -> None:
        """Once the broker has an administrator (a user with the ``admin`` permission), the operator
        (FENCEMQ_USER, FENCEMQ_USER_PASSWORD) must be a user with this command's permission on its
        topic. Before that, Redis's own credentials are the only gate, as for any tool that reaches
        Redis directly: which is how the first administrator is added."""
        # "user add" needs what "user" needs, unless the subcommand is named ("scheduled cancel")
        action = PERMISSION_OF.get(self.command) or PERMISSION_OF.get(self.command.split()[0])
        if self._authorized or action is None:
            return
        from fencemq.ops.users import UserStore, grants_cover

        store = UserStore(client, self.keys.users)
        if not any(grants_cover(u, "admin", "#") for u in await store.list()):
            self._authorized = True
            return
        name, password = os.environ.get(ENV_USER), os.environ.get(ENV_USER_PASSWORD)
        if not name or password is None:
            raise NoPermission(f"this broker has users: set {ENV_USER} and {ENV_USER_PASSWORD} to those of a user "
                               f"with the '{action}' permission (fencemq user grant NAME {action} FILTER)")
        user = await store.authenticate(name, password)
        if user is None:
            raise WrongPassword(f"{ENV_USER}/{ENV_USER_PASSWORD}: invalid username-password pair")
        if not grants_cover(user, action, self.topic):
            raise NoPermission(user.missing(action, self.topic))
        self._authorized = True

    def fail(self, message: str, code: int) -> None:
        fail(self.command, CliError(message, code))
        raise typer.Exit(code)

    def _probe(self) -> bool:
        try:
            client = connect(self.url)
        except CliError as exc:
            self.fail(exc.message, exc.code)
        try:
            if self.cluster:
                return True
            try:
                return int(client.info("cluster").get("cluster_enabled", 0)) == 1
            except redis.ResponseError:
                return False
        finally:
            client.close()

    def run(self, body: Callable[[Any, Keyspace], Awaitable[T]], *, writes: bool = False) -> T:
        """Run ``body(async client, keyspace)``; every failure becomes one line and an exit code.

        ``writes``: the body changes the broker's state, which a Redis that may evict keys would
        lose without a word: it is refused there (EVICTING, saying what to set), as a worker refuses
        to start (fences/memory.py)."""
        cluster = self._probe()

        async def main() -> T:
            client = async_client(self.url, cluster)
            try:
                await self.authorize(client)
                if writes:
                    from fencemq.fences.memory import check_policy

                    await check_policy(client)
                return await body(client, self.keys)
            finally:
                await client.aclose()

        try:
            return asyncio.run(main())
        except CliError as exc:
            self.fail(exc.message, exc.code)
        except NotFound as exc:
            self.fail(exc.message, EXIT_NOT_FOUND)
        except (NoPermission, WrongPassword) as exc:
            self.fail(exc.resp(), EXIT_DENIED)
        except (BadArgument, LimitExceeded) as exc:
            self.fail(exc.message, EXIT_USAGE)
        except FenceMQError as exc:
            self.fail(exc.resp(), EXIT_NOT_FOUND)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self.fail(unreachable_message(self.url, exc), EXIT_UNREACHABLE)
        except redis.RedisError as exc:
            self.fail(f"Redis at {safe_url(self.url)} answered {type(exc).__name__}: {exc}", EXIT_NOT_FOUND)
        except Exception as exc:
            from redis.exceptions import RedisClusterException

            if isinstance(exc, RedisClusterException):
                self.fail(f"Redis at {safe_url(self.url)} does not work as a Cluster ({exc}); "
                          "leave out --cluster for a single server", EXIT_UNREACHABLE)
            raise
        raise AssertionError("unreachable")  # pragma: no cover


def _queue(ctx: Ctx, topic: str, lmq: str | None, owner: str | None = None) -> QueueRef:
    """The queue an operator names: a topic [--lmq], a filter --owner client, or '$share/<group>/<filter>'."""
    try:
        check_topic(topic)
        if topic.startswith(SHARE_PREFIX) or topic.startswith("$share:"):
            target = parse_target(topic)  # says how a malformed one is written
            if lmq is not None or owner is not None:
                raise BadArgument(f"{topic} names a shared group's queue already; drop --lmq and --owner")
            ctx.topic = target.filter
            return QueueRef(target.filter, None, SHARE_PREFIX + str(target.share))
        if has_wildcard(topic) and owner is None:
            raise BadArgument(
                f"{topic} is a topic filter: each subscriber to it has a queue of its own; give --owner "
                f"<client id> for a client's, or name a shared group's as '$share/<group>/{topic}' "
                "(`fencemq queues` lists them)")
        if lmq is not None and owner is not None:
            raise BadArgument("give --lmq (a lite queue) or --owner (a filter subscription), not both")
        if lmq is not None:
            check_name(lmq, "lmq")
        if owner is not None and not owner:
            raise BadArgument("--owner is empty")
    except BadArgument as exc:
        ctx.fail(exc.message, EXIT_USAGE)
    ctx.topic = topic
    return QueueRef(topic, lmq, owner)


def _confirm(ctx: Ctx, yes: bool, question: str, refusal: str) -> None:
    """Destructive commands ask first: on a terminal, a y/N question; without one, --yes is required (exit 2)."""
    if yes:
        return
    if not sys.stdin.isatty():
        ctx.fail(f"refusing to {refusal} without --yes: no terminal to confirm on", EXIT_USAGE)
    if not typer.confirm(question, default=False, err=True):
        ctx.fail("nothing done", EXIT_NOT_FOUND)


def _name(ctx: Ctx, value: str, what: str) -> str:
    try:
        return check_name(value, what)
    except BadArgument as exc:
        ctx.fail(exc.message, EXIT_USAGE)
    return value  # pragma: no cover


def _emit_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def _out() -> Console:
    return Console(highlight=False)


def _err() -> Console:
    return Console(stderr=True, highlight=False)


@contextmanager
def _progress(label: str, enabled: bool = True) -> Iterator[Callable[[int, int | None], None] | None]:
    """A rich progress display on stderr while a long walk runs (only on a terminal)."""
    err = _err()
    if not enabled or not err.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    # A bar when the total is known (sweep of listed queues), else a running count (SCAN cannot know it).
    with Progress(SpinnerColumn(), TextColumn(label + ":"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


# -- formatting -----------------------------------------------------------------------------


NAME_WIDTH = 16  # a name column is at least this wide (or as its longest name) before it folds


class FitTable(Table):
    """A table that fits the width it is drawn in without cutting a header.

    Every column is at least as wide as its header's longest line (a name
    column, which folds, as wide as its longest name up to NAME_WIDTH); when
    the table is still too wide the columns named in ``drop`` go, first named
    first. A wider terminal shows them all: the fit is made at each drawing,
    for the width of that drawing.
    """

    drop: tuple[str, ...] = ()

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        self._fit(console, options)
        yield from super().__rich_console__(console, options)

    def _fit(self, console: Console, options: ConsoleOptions) -> None:
        for col in self.columns:
            floor = max(cell_len(line) for line in str(col.header).split("\n"))
            if col.overflow == "fold":
                longest = max((cell_len(str(cell)) for cell in col._cells), default=0)
                floor = max(floor, min(longest, NAME_WIDTH))
            col.min_width = max(col.min_width or 0, floor)
        for header in self.drop:
            if not self._cramped(console, options):
                return
            self.columns = [c for c in self.columns if str(c.header) != header]
            for i, c in enumerate(self.columns):
                c._index = i

    def _cramped(self, console: Console, options: ConsoleOptions) -> bool:
        """Would rich, at this width, give a column less than its floor?"""
        room = options.max_width - self._extra_width
        widths = self._calculate_column_widths(console, options.update_width(room))
        return sum(widths) > room or any(w - self._get_padding_width(c._index) < (c.min_width or 0) for w, c in zip(widths, self.columns))


def _table(title: str | None = None, drop: tuple[str, ...] = ()) -> FitTable:
    """A table of the CLI's look; ``drop``: the headers of the columns a narrow terminal does without, first first."""
    table = FitTable(title=Text(title, style="bold") if title else None, title_justify="left", box=box.SIMPLE_HEAD,
                     pad_edge=False, collapse_padding=True, min_width=cell_len(title) if title else None)
    table.drop = drop
    return table


def _count(n: int, noun: str) -> str:
    """'1 key', '2 keys', '0 keys'."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def _when(ms: int | None) -> str:
    if ms is None:
        return "–"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _secs(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = abs(seconds)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{s / 60:.1f}m"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _deadline(in_s: float | None) -> Text:
    if in_s is None:
        return Text("in mailbox", style="dim")
    if in_s >= 0:
        return Text(f"in {_secs(in_s)}")
    return Text(f"{_secs(in_s)} overdue", style="yellow")


def _opt(value: Any) -> str:
    return "–" if value is None or value == "" else str(value)


def _rate(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _row(table: Table, *cells: Any) -> None:
    """Add a row; plain strings are shown as they are (names may contain '[', never markup)."""
    table.add_row(*(c if isinstance(c, Text) else Text(_opt(c)) for c in cells))


def _kv(rows: list[tuple[str, Any]], title: str | None = None) -> Table:
    t = Table(title=Text(title, style="bold") if title else None, title_justify="left", box=None,
              show_header=False, pad_edge=False, min_width=cell_len(title) if title else None)
    t.add_column("field", style="dim")
    t.add_column("value", overflow="fold")
    for k, v in rows:
        _row(t, k, v if isinstance(v, Text) else Text(_opt(v)))
    return t


def _member_state(m: dict[str, Any]) -> Text:
    out = Text()
    if m.get("owner"):
        out.append("owner ", style="cyan")
    if m.get("marker") is not None:
        out.append(f"evicted by {m['marker']} ", style="red")
    if m.get("suspected"):
        out.append("suspected ", style="yellow")
    if m.get("ended"):
        out.append("ended ", style="dim")
    if m.get("push") and not m.get("online", True):
        out.append("offline ", style="dim")
    return out if out.plain else Text("ok", style="green")


def _checkouts_table(rows: list[dict[str, Any]], total: int, title: str = "Checkouts") -> Table | Text:
    if not rows:
        return Text("No checkouts." if not total else f"{total} checkouts (none shown; raise --limit)", style="dim")
    t = _table(f"{title} ({len(rows)} of {total}, soonest deadline first)" if total > len(rows) else title,
               drop=("failures", "deliveries", "epoch", "group"))
    for col, kw in (("tag", {}), ("group", {"overflow": "fold"}), ("member", {"overflow": "fold"}),
                    ("id", {"justify": "right"}), ("epoch", {"justify": "right"}),
                    ("deliveries", {"justify": "right"}), ("failures", {"justify": "right"}),
                    ("lease", {"min_width": 10})):
        t.add_column(col, **kw)
    for c in rows:
        epoch = Text(str(c["epoch"]), style="red" if c.get("stale") else "")
        if c.get("stale"):
            epoch.append(" stale")
        _row(t, c["tag"], c["group"], c["member"], str(c["id"]), epoch, str(c["acquisitions"]),
                  str(c["failures"]), _deadline(c["expires_in_s"]))
    return t


def _members_table(members: list[dict[str, Any]], title: str = "Members") -> Table | Text:
    if not members:
        return Text("No members.", style="dim")
    t = _table(title, drop=("lock ms", "max", "mailbox"))
    for col, kw in (("member", {"overflow": "fold"}), ("state", {}), ("delivered", {"justify": "right"}),
                    ("max", {"justify": "right"}), ("checked\nout", {"justify": "right"}),
                    ("mailbox", {"justify": "right"}), ("lock ms", {"justify": "right"}),
                    ("suspected\nfor", {"justify": "right"})):
        t.add_column(col, **kw)
    for m in members:
        mailbox = "–" if m.get("mailbox_depth") is None else f"{m['mailbox_depth']}/{_opt(m.get('capacity'))}"
        _row(t, Text(m["member"], style="bold"), _member_state(m), str(m["delivered"]), _opt(m["max"]),
                  str(m.get("checkouts", "–")), mailbox, _opt(m["lock_ms"]),
                  _secs(m["suspected_for_s"]) if m["suspected"] else "–")
    return t


