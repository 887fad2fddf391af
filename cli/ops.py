"""Operator commands: queues, lmqs, inspect, evict, sweep, seek, purge, dlq, retention, scheduled, top, bench.

``register(app)`` adds them to a Typer app (cli/main.py calls it); each group
of commands has its module: cli/list_cmd.py (queues, lmqs), cli/inspect_cmd.py,
cli/write_cmd.py (evict, sweep, seek, purge), cli/dlq_cmd.py, cli/retention_cmd.py, cli/top_cmd.py,
cli/bench_cmd.py. What they read and write is in broker/ops/ (operations.py,
inspection.py, maintenance.py); the commands only parse options and present
results: rich tables by default, ``--json`` for scripts (one JSON document on
stdout; ``top --json`` prints one per refresh, one per line).

Every command that talks to Redis takes ``--redis-url`` (default
$FENCEMQ_REDIS_URL, else the private Redis of the one ``fencemq serve``
running here: cli/local_broker.py), ``--prefix`` (default $FENCEMQ_PREFIX or fmq) and
``--cluster`` (force Redis Cluster mode; otherwise detected from
``INFO cluster``: every master is visited).

Exit codes: 0 success; 1 not found (no such queue, group, member, session or
dead letter to replay) or refused (a purge not confirmed, a Redis error
reply); 2 usage (bad option, bad name, bad cursor; purge without --yes when
not interactive), no Redis URL, or the Redis at it does not answer (one line
on stderr naming the URL and what to check).
"""

from __future__ import annotations

import typer

from fencemq.cli.bench_cmd import bench
from fencemq.cli.dlq_cmd import dlq_app
from fencemq.cli.inspect_cmd import inspect_app
from fencemq.cli.list_cmd import lmqs, queues
from fencemq.cli.priority_cmd import priority_app
from fencemq.cli.retention_cmd import retention_app
from fencemq.cli.schedule_cmd import scheduled_app
from fencemq.cli.top_cmd import top
from fencemq.cli.user_cmd import user_app
from fencemq.cli.write_cmd import evict, purge, seek, sweep


def register(app: typer.Typer) -> None:
    """Add the operator commands to the `fencemq` app."""
    app.command("queues")(queues)
    app.command("lmqs")(lmqs)
    app.add_typer(inspect_app, name="inspect")
    app.command("evict")(evict)
    app.command("sweep")(sweep)
    app.command("seek")(seek)
    app.command("purge")(purge)
    app.add_typer(dlq_app, name="dlq")
    app.command("top")(top)
    app.add_typer(user_app, name="user")
    app.add_typer(retention_app, name="retention")
    app.add_typer(scheduled_app, name="scheduled")
    app.add_typer(priority_app, name="priority")
    app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(bench)


if __name__ == "__main__":  # pragma: no cover
    standalone = typer.Typer(add_completion=False, no_args_is_help=True)
    register(standalone)
    standalone()

