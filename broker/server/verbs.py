"""The verbs of the wire protocol (docs/protocol.md), one handler each.

``Verbs.run(session, request)`` looks the request's verb up in a table and
calls its handler with the session it acts for and the keyword arguments that
fencemq.protocol.commands parsed; the handler returns the reply value. Errors
are raised as FenceMQError and turned into RESP errors by the connection. A
handler never reads the socket: a verb that waits asks its session to watch
for a hang-up meanwhile. Here: transactions and the connection's and session's
verbs; the messaging verbs (publish, subscribe, consume) are
fencemq.server.messaging_verbs's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fencemq import __version__
from fencemq.errors import BadArgument, FenceMQError, LimitExceeded, NoAuth, TransactionAborted
from fencemq.fences.redis_errors import REDIS_FAILURES, redis_failure
from fencemq.protocol.command_docs import command_docs, command_info, known
from fencemq.protocol.commands import COMMANDS, TABLE, Request
from fencemq.protocol.resp import ErrorReply, SimpleString, Verbatim
from fencemq.server import metrics
from fencemq.server.introspection import client_line, info_text
from fencemq.server.messaging_verbs import OK, MessagingVerbs
from fencemq.server.services import Services
from fencemq.server.session import Session, Transaction

QUEUED = SimpleString("QUEUED")
BEFORE_AUTH = frozenset({"HELLO", "AUTH", "PING", "QUIT", "RESET"})
# Run at once inside a transaction, never queued (as in Redis).
TRANSACTION_CONTROL = frozenset({"MULTI", "EXEC", "DISCARD", "RESET", "QUIT"})

Handler = Callable[..., Awaitable[Any]]


class Verbs(MessagingVerbs):
    def __init__(self, services: Services) -> None:
        self.services = services
        self.config = services.config
        # One handler per verb of the command table, named after it; a verb
        # without one fails here, when the worker starts, not on first use.
        self.handlers: dict[str, Handler] = {verb: getattr(self, verb.lower()) for verb in TABLE}

    async def run(self, session: Session, request: Request) -> Any:
        self.admit(session, request)
        if session.transaction is not None and request.verb not in TRANSACTION_CONTROL:
            try:
                return self._queue(session.transaction, request)
            except FenceMQError as exc:
                session.refused(exc)
                raise
        return await self.handlers[request.verb](session, **request.args)

    def admit(self, session: Session, request: Request) -> None:
        """What every command meets before its handler, alone or in a pipelined run: noted,
        counted, and refused (LIMIT, NOAUTH) as it would be alone."""
        args = request.args
        session.note_command(request.verb)
        try:
            if len(args.get("payloads", ())) > self.config.max_batch or \
                    len(args.get("tags", ())) > self.config.max_batch:
                raise LimitExceeded(f"more than {self.config.max_batch} items in one command; split it")
            if request.verb in ("PUB", "MPUB"):
                self._check_pub_extras(args)
            metrics.count_command(request.verb)
            if not session.authed and request.verb not in BEFORE_AUTH:
                raise NoAuth("authentication required; send AUTH password or HELLO 3 AUTH user password")
        except FenceMQError as exc:
            session.refused(exc)
            raise

    def _check_pub_extras(self, args: dict[str, Any]) -> None:
        """Headers and dedup ids are stored with the message: they have limits of their own."""
        config = self.config
        for dedup_id in args.get("dedup_ids") or ():
            if dedup_id is not None and len(dedup_id.encode()) > config.max_id_bytes:
                raise LimitExceeded(f"a dedup id of {len(dedup_id.encode())} bytes exceeds max_id_bytes "
                                    f"({config.max_id_bytes})")
        headers = args.get("headers") or {}
        if len(headers) > config.max_headers:
            raise LimitExceeded(f"{len(headers)} headers exceed max_headers ({config.max_headers})")
        size = sum(len(k.encode()) + len(v.encode()) for k, v in headers.items())
        if size > config.max_header_bytes:
            raise LimitExceeded(f"headers of {size} bytes exceed max_header_bytes ({config.max_header_bytes})")

    # -- transactions ----------------------------------------------------------------

    def _queue(self, transaction: Transaction, request: Request) -> Any:
        if request.verb in ("PULL", "TAKE") and request.args.get("block_ms") is not None:
            raise BadArgument(f"{request.verb} … BLOCK waits, and a transaction never waits; "
                              f"send it without BLOCK inside MULTI, or outside the transaction")
        transaction.queued.append(request)
        return QUEUED

    async def multi(self, session: Session, argv: list[bytes]) -> Any:
        if session.transaction is not None:
            raise FenceMQError("MULTI calls can not be nested")
        session.transaction = Transaction()
        return OK

    async def discard(self, session: Session, argv: list[bytes]) -> Any:
        if session.transaction is None:
            raise FenceMQError("DISCARD without MULTI")
        session.transaction = None
        return OK

    async def exec(self, session: Session, argv: list[bytes]) -> Any:
        """Run the queued commands in order, each as it would run alone; their replies (errors among them)."""
        transaction, session.transaction = session.transaction, None
        if transaction is None:
            raise FenceMQError("EXEC without MULTI")
        if transaction.refused:
            raise TransactionAborted("Transaction discarded because of previous errors.")
        replies: list[Any] = []
        for request in transaction.queued:
            try:
                replies.append(await self.handlers[request.verb](session, **request.args))
            except REDIS_FAILURES as exc:
                replies.append(ErrorReply(redis_failure(exc, request.verb, self.services.core.fences).resp()))
            except FenceMQError as exc:
                metrics.ERRORS.labels(exc.code).inc()
                replies.append(ErrorReply(exc.resp()))
        return replies

    # -- connection and session ------------------------------------------------------

    async def hello(self, session: Session, proto: int | None = None, username: str | None = None,
                    password: str | None = None, client_id: str | None = None, takeover: bool = False) -> Any:
        if password is not None:
            await self.auth(session, argv=[p.encode() for p in ((username, password) if username else (password,))])
        if not session.authed:
            raise NoAuth("HELLO must carry AUTH user password on this server")
        if proto is not None:
            session.proto = proto
        if client_id is not None and (client_id != session.client_id or takeover):
            await session.bind(client_id, anonymous=False, takeover=takeover)
        elif takeover:
            raise BadArgument("HELLO … TAKEOVER goes with SETNAME id: the session to take over")
        return {
            "server": "fencemq", "version": __version__, "proto": session.proto,
            "id": session.client_id or session.anonymous_id, "worker": self.services.worker_id,
            "mode": "standalone", "role": "master", "modules": [],
            "lock_ms": self.config.default_lock_ms,  # what a client renewing its locks needs to know
            # whether the named session was there before this connection: a client reconnecting after
            # longer than its lease finds it "new" (every subscription gone) and says so (docs/sdk.md)
            "session": "resumed" if session.bound and not session.anonymous and session.resumed else "new",
        }

    async def auth(self, session: Session, argv: list[bytes]) -> Any:
        if not self.config.needs_auth:
            raise FenceMQError("AUTH called without any password configured for this worker")
        name, password = (None, argv[0]) if len(argv) == 1 else (argv[0].decode("utf-8", "replace"), argv[1])
        try:
            await self.services.gate.log_in(session.gate_pass, name, password)
        finally:
            if session.gate_pass.closing:
                session.closing = True  # the reply goes out, then the connection closes
        session.authed = True
        return OK

    async def ping(self, session: Session, argv: list[bytes]) -> Any:
        return argv[0] if argv else SimpleString("PONG")

    async def quit(self, session: Session, argv: list[bytes]) -> Any:
        session.quit = True
        session.closing = True
        return OK

    async def select(self, session: Session, argv: list[bytes]) -> Any:
        if argv[0] != b"0":
            raise BadArgument("FenceMQ has a single database; SELECT 0")
        return OK

    async def echo(self, session: Session, argv: list[bytes]) -> Any:
        return argv[0]

    async def reset(self, session: Session, argv: list[bytes]) -> Any:
        await session.reset()
        return SimpleString("RESET")

    async def info(self, session: Session, argv: list[bytes]) -> Any:
        port = int(session.local.rsplit(":", 1)[1]) if ":" in session.local else None
        sections = [a.decode("utf-8", "replace") for a in argv]
        return Verbatim(info_text(self.services.roster, self.services.worker_id, port, sections))

    async def command(self, session: Session, argv: list[bytes]) -> Any:
        sub = argv[0].decode("utf-8", "replace").upper() if argv else ""
        if sub == "COUNT" and len(argv) == 1:
            return len(COMMANDS)
        if sub == "LIST" and len(argv) == 1:
            return [verb.lower() for verb in COMMANDS]
        if sub == "INFO":
            return [command_info(verb) for verb in (known(argv[1:]) if len(argv) > 1 else list(COMMANDS))]
        if sub == "DOCS":
            return command_docs([v for v in (known(argv[1:]) if len(argv) > 1 else list(COMMANDS)) if v], __version__)
        if not argv:
            return [command_info(verb) for verb in COMMANDS]
        raise BadArgument("COMMAND takes COUNT, LIST, INFO [command ...] or DOCS [command ...]")

    async def client(self, session: Session, argv: list[bytes]) -> Any:
        sub = argv[0].decode("utf-8", "replace").upper()
        if sub == "SETNAME" and len(argv) == 2:
            await session.bind(argv[1].decode("utf-8", "replace"), anonymous=False)
            return OK
        if sub == "TAKEOVER" and len(argv) == 1:
            if session.client_id is None or session.anonymous:
                raise BadArgument("CLIENT TAKEOVER takes over this connection's named session: "
                                  "CLIENT SETNAME id (or HELLO … SETNAME id) first")
            await session.bind(session.client_id, anonymous=False, takeover=True)
            return OK
        if sub == "GETNAME" and len(argv) == 1:
            return session.client_id if not session.anonymous else None
        if sub == "ID" and len(argv) == 1:
            return session.number
        if sub == "INFO" and len(argv) == 1:
            return Verbatim(client_line(session))
        if sub == "LIST":
            # This connection and those of its own session here: never another client's.
            return Verbatim("".join(client_line(s) for s in self.services.roster.sharing(session)))
        if sub == "SETINFO" and len(argv) == 3:
            attr = argv[1].decode("utf-8", "replace").lower()
            if attr not in ("lib-name", "lib-ver"):
                raise BadArgument("CLIENT SETINFO takes LIB-NAME or LIB-VER")
            session.library[attr] = argv[2].decode("utf-8", "replace")[:128].replace(" ", "-")
            return OK
        if sub in ("NO-EVICT", "NO-TOUCH") and len(argv) == 2:
            return OK  # nothing of a worker is evicted or touched
        if sub == "DELIVERIES" and len(argv) == 2:
            shape = argv[1].decode("utf-8", "replace").upper()
            if shape not in ("MAP", "FLAT"):
                raise BadArgument("CLIENT DELIVERIES takes MAP (a map per delivery in RESP3, the default) or FLAT "
                                  "(a flat array of fields and values, as RESP2 writes it)")
            session.flat_deliveries = shape == "FLAT"
            return OK
        raise BadArgument("CLIENT takes SETNAME id, GETNAME, ID, INFO, LIST, SETINFO attr value, TAKEOVER, "
                          "NO-EVICT on|off, NO-TOUCH on|off or DELIVERIES map|flat")

    async def heartbeat(self, session: Session, sync: tuple[str, str, list[str]] | None = None) -> Any:
        client = await session.ensure()
        if sync is not None:
            topic, group, lmqs = sync
            self.services.gate.check_group(group)
            await self.services.sessions.resync(client, topic, group, lmqs)
        sign = self.services.handles.sign_notice
        return [sign(n) for n in await self.services.sessions.drain_notices(client)]
