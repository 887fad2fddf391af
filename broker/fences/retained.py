"""Retained messages: the last one published with RETAIN per topic, found by what a filter can match.

A new filter subscription (RESP ``SUB a/+/c``, an MQTT SUBSCRIBE) gets the retained messages its
filter matches. They are indexed by topic level (``lua/lib/shared.lua`` ``retained_edges``: a trie
of levels and a lex-sorted set of the topics, kept by lua/retain.lua and lua/unretain.lua in the
same call as the message), and a lookup reads only what its filter can match:

* an exact topic: one HGET;
* a ``+`` level: the names of the children of the paths matched so far (one pipelined read per
  ``+``), so ``a/+/c`` reads the names under ``a`` and the messages of ``a/*/c`` alone;
* a ``#``: the names at and under the paths matched so far (lex ranges of the topics, in pages).

The bodies read are those of topics the filter matches, never another's (was: every retained
message, for every SUBSCRIBE). Protocol: docs/protocol.md, "Retained messages".
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fencemq.fences.context import FenceContext
from fencemq.fences.registry import fence
from fencemq.model.topics import has_wildcard, matches
from fencemq.model.values import text

RETAIN = fence("retain", "retained topics levels indexed", "topic body reindex")
UNRETAIN = fence("unretain", "retained topics levels", "topic")
PAGE = 1000  # names read per lex range page, children listings per pipeline, bodies per HMGET


class Retained:
    def __init__(self, ctx: FenceContext) -> None:
        self.ctx = ctx
        self.redis, self.keys = ctx.redis, ctx.keys
        self._indexed = False

    def _fence_keys(self) -> dict[str, str]:
        return {"retained": self.keys.retained, "topics": self.keys.retained_topics,
                "levels": self.keys.retained_levels, "indexed": self.keys.retained_indexed}

    async def keep(self, topic: str, body: bytes) -> None:
        """``body`` (stored form) is ``topic``'s retained message from now on."""
        await self.ctx.fences.run(RETAIN, None, extra_keys=self._fence_keys(), topic=topic, body=body, reindex=0)

    async def clear(self, topic: str) -> None:
        await self.ctx.fences.run(UNRETAIN, None, extra_keys=self._fence_keys(), topic=topic)

    async def matching(self, filt: str) -> AsyncIterator[list[bytes]]:
        """The retained messages ``filt`` matches (stored forms), in batches of at most PAGE."""
        await self._ensure_index()
        async for names in self._candidates(filt):
            names = [n for n in names if matches(filt, n)]
            for start in range(0, len(names), PAGE):
                bodies = await self.redis.hmget(self.keys.retained, names[start:start + PAGE])
                found = [b for b in bodies if b is not None]
                if found:
                    yield found

    async def _candidates(self, filt: str) -> AsyncIterator[list[str]]:
        """Topic names that may match ``filt``: every match, and only names the index leads to."""
        if not has_wildcard(filt):
            yield [filt]
            return
        paths = [""]  # the trie paths matched so far, each ending in '/' (the root: empty)
        for level in filt.split("/"):
            if level == "#":
                # the level above itself ('a/#' matches 'a'), then everything under each path
                yield [p[:-1] for p in paths if p]
                for p in paths:
                    async for names in self._under(p):
                        yield names
                return
            if level == "+":
                paths = [p + child + "/" for p, children in zip(paths, await self._children(paths), strict=True)
                         for child in children]
            else:
                paths = [p + level + "/" for p in paths]
            if not paths:
                return
        for start in range(0, len(paths), PAGE):
            yield [p[:-1] for p in paths[start:start + PAGE]]

    async def _children(self, paths: list[str]) -> list[list[str]]:
        """The next levels under each path, as the trie has them."""
        out: list[list[str]] = []
        for start in range(0, len(paths), PAGE):
            pipe = self.redis.pipeline(transaction=False)
            for p in paths[start:start + PAGE]:
                prefix = p.encode() + b"\0"
                pipe.zrangebylex(self.keys.retained_levels, b"[" + prefix, b"(" + p.encode() + b"\1")
            for p, edges in zip(paths[start:start + PAGE], await pipe.execute(), strict=True):
                skip = len(p.encode()) + 1
                out.append([e[skip:].decode() for e in edges])
        return out

    async def _under(self, path: str) -> AsyncIterator[list[str]]:
        """The retained topics under ``path`` (every one for the root), in pages."""
        start: bytes = b"[" + path.encode() if path else b"-"
        end: bytes = b"(" + path[:-1].encode() + b"0" if path else b"+"  # '/' + 1: past 'path/…'
        while True:
            names = await self.redis.zrangebylex(self.keys.retained_topics, start, end, 0, PAGE)
            if names:
                yield [text(n) for n in names]
            if len(names) < PAGE:
                return
            start = b"(" + names[-1]

    async def _ensure_index(self) -> None:
        """Index the retained messages an older version kept, before the index existed (once per
        Redis, idempotent; a Redis whose first retained message was kept by this version has nothing
        to do: lua/retain.lua marks it indexed then)."""
        if self._indexed:
            return
        if not await self.redis.exists(self.keys.retained_indexed):
            cursor = 0
            while True:
                cursor, found = await self.redis.hscan(self.keys.retained, cursor, count=PAGE)
                for topic in found:
                    await self.ctx.fences.run(RETAIN, None, extra_keys=self._fence_keys(), topic=text(topic),
                                              body="", reindex=1)
                if int(cursor) == 0:
                    break
            await self.redis.set(self.keys.retained_indexed, 1)
        self._indexed = True
