"""A connection's pipelined commands, run: each refused or answered, in order, batched where it may.

A mixin of fencemq.server.connection.ClientConnection (the shell that reads and writes). Pipelined
PUBs to one queue run as one fence call, pipelined lmq SUBs of one topic too, and an ACK
pipelined with a PULL of the same handle (the consume loop) makes one round trip to Redis for
both fences, run in that order; a refusal is its own command's reply, never its neighbours'.
"""

from __future__ import annotations

from typing import Any

from fencemq.config import Config
from fencemq.errors import FenceMQError, LimitExceeded
from fencemq.fences.redis_errors import REDIS_FAILURES, redis_failure
from fencemq.protocol.commands import Request, parse
from fencemq.protocol.resp import ErrorReply
from fencemq.server import metrics
from fencemq.server.session import Session
from fencemq.server.verbs import Verbs


class Pipeline:
    __slots__ = ()
    config: Config
    session: Session
    verbs: Verbs

    async def execute(self, commands: list[list[bytes]]) -> list[Any]:
        """The replies to pipelined commands, in order; PUBs back to back to one queue run as one."""
        requests: list[Request | FenceMQError] = []
        for args in commands:
            try:
                if len(args) > self.config.max_args:
                    raise LimitExceeded(
                        f"{len(args)} arguments exceed the limit of {self.config.max_args}; split the command"
                    )
                self._check_arg_sizes(args)
                requests.append(parse(args))
            except FenceMQError as exc:
                requests.append(exc)
        replies: list[Any] = []
        i = 0
        while i < len(requests):
            req = requests[i]
            if isinstance(req, FenceMQError):
                self.session.refused(req)
                replies.append(self._error(req))
                i += 1
                continue
            batching = self.session.authed and self.session.transaction is None
            if batching and self._ack_then_pull(requests, i):
                ack, pull = requests[i], requests[i + 1]
                try:
                    outcomes = await self.verbs.ack_then_pull(self.session, ack, pull)  # type: ignore[arg-type]
                except REDIS_FAILURES as exc:
                    outcomes = [exc, exc]
                replies.extend(self._outcome(r, out) for r, out in zip((ack, pull), outcomes))  # type: ignore
                i += 2
                if self.session.quit:
                    break
                continue
            key = req.batch_key() if batching else None
            j = i + 1
            if key is not None:
                while j < len(requests) and isinstance(requests[j], Request) and requests[j].batch_key() == key:
                    j += 1
            if j - i > 1:
                if key[0] == "PUB":  # type: ignore[index]
                    # each command checked as alone; a refusal is its own reply, never its neighbours'
                    outcomes = await self.verbs.publish_batch(self.session, requests[i:j])  # type: ignore[arg-type]
                else:
                    try:
                        outcomes = await self.verbs.sub_lmq_batch(self.session, requests[i:j])  # type: ignore
                    except (FenceMQError, *REDIS_FAILURES):
                        # refused before any SUB ran, or cut short by Redis (a SUB may run twice: the
                        # same member again): one by one
                        outcomes = [await self._run_one(one) for one in requests[i:j]]  # type: ignore[arg-type]
                replies.extend(self._outcome(req, out) for req, out in zip(requests[i:j], outcomes))  # type: ignore
            else:
                replies.append(await self._run_one(req))
            i = j
            if self.session.quit:
                break
        return replies

    @staticmethod
    def _ack_then_pull(requests: list[Request | FenceMQError], i: int) -> bool:
        """``ACK h …`` followed by ``PULL h …`` of the same handle: one round trip to Redis for both."""
        if i + 1 >= len(requests):
            return False
        a, b = requests[i], requests[i + 1]
        return (isinstance(a, Request) and isinstance(b, Request) and a.verb == "ACK" and b.verb == "PULL"
                and a.args.get("handle") == b.args.get("handle"))

    def _check_arg_sizes(self, args: list[bytes]) -> None:
        """Every argument but a payload is small: names, tags, handles, options."""
        limit = self.config.max_arg_bytes
        if max(map(len, args)) <= limit:  # the common case, without a Python step per argument
            return
        verb = args[0][:8].upper()
        # PUB topic payload …, MPUB topic n payload… …: the payloads have max_payload
        payloads = (range(2, 3) if verb == b"PUB" else
                    range(3, len(args)) if verb == b"MPUB" else range(0))
        for i, arg in enumerate(args):
            if len(arg) > limit and i not in payloads:
                raise LimitExceeded(f"an argument of {len(arg)} bytes exceeds max_arg_bytes ({limit}); "
                                    f"only payloads may be larger")

    async def _run_one(self, req: Request) -> Any:
        try:
            return await self.verbs.run(self.session, req)
        except FenceMQError as exc:
            return self._error(exc)
        except REDIS_FAILURES as exc:
            return self._error(redis_failure(exc, req.verb, self.session.services.core.fences))

    def _outcome(self, req: Request, outcome: Any) -> Any:
        """A batched command's reply: its value, or its refusal as an error reply."""
        if isinstance(outcome, FenceMQError):
            return self._error(outcome)
        if isinstance(outcome, REDIS_FAILURES):
            return self._error(redis_failure(outcome, req.verb, self.session.services.core.fences))
        return outcome

    def _error(self, exc: FenceMQError) -> ErrorReply:
        metrics.ERRORS.labels(exc.code).inc()
        return ErrorReply(exc.resp())
