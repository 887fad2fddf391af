"""The web UI's pages: what each one reads (over broker/ops/, the reads the CLI uses) and shows.

``UI`` holds what the pages share (the Redis client, the gate's answers through ui/auth.py, the
sampler and the templates); ``PAGES`` names each page's template and the method that reads its data.
The routes that serve them are ui/app.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse

from fencemq.errors import BadArgument
from fencemq.fences.memory import read_alarms
from fencemq.model.keys import Keyspace, QueueRef, queue_ref
from fencemq.model.values import text
from fencemq.ops.operations import now_ms
from fencemq.ops.priority import LEVELS_SHOWN
from fencemq.ops import dashboard, history, inspection, maintenance, operations, overview
from fencemq.ops.users import UserStore
from fencemq.server.gate import Gate
from fencemq.ui import charts, formatting
from fencemq.ui.auth import (
    Logins, UIGate,
)
from fencemq.ui.live import Sampler

HERE = Path(__file__).parent
PAGE_SIZES = (25, 50, 100, 200)
SORTS = ("name", "kind", "backlog", "checkouts", "dead_letters", "members", "idle_s")
LIVE_PAGES = ("overview", "queues", "queue", "lmqs", "sessions", "dlq", "alarms", "redis")


class UI(UIGate):
    """The app's state: Redis, the keyspace, logins and the overview sampler."""

    def __init__(self, redis_url: str | None = None, *, redis: Any = None, prefix: str = "fmq",
                 password: str | None = None, interval: float = 2.0, lease_ms: int | None = 10_000,
                 title: str = "FenceMQ", gate: Gate | None = None) -> None:
        if redis_url is None and redis is None:
            raise BadArgument("the UI needs a Redis URL or client")
        self.redis_url, self.redis = redis_url, redis
        self.keys = Keyspace(prefix)
        self.password = password
        # the worker's gate when a worker serves the UI (serve --http-port), else one of its own over Redis
        self.gate = gate
        self.logins = Logins()
        self.sampler = Sampler(self.keys, interval=interval, lease_ms=lease_ms, url=redis_url)
        self.interval = interval
        self.title = title
        self.env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]),
                               trim_blocks=True, lstrip_blocks=True)
        self.env.filters.update(ago=formatting.ago, num=formatting.num, span=formatting.span,
                                span_in=formatting.span_in, state=formatting.member_state,
                                bytes=formatting.size, clock=formatting.clock)
        self.env.globals.update(urlencode=urlencode, chart=charts.line_chart)

    @property
    def users(self) -> UserStore:
        return UserStore(self.redis, self.keys.users)

    # -- rendering ------------------------------------------------------------------------

    def render(self, request: Request, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        login = self.login(request)
        html = self.env.get_template(template).render(
            request=request, login=login, title=self.title, prefix=self.keys.prefix, interval=self.interval,
            path=request.url.path, query=str(request.url.query), **ctx)
        return HTMLResponse(html, status_code=status, headers={"Cache-Control": "no-store"})

    def fragment(self, template: str, request: Request, **ctx: Any) -> str:
        module = self.env.get_template(f"partials/{template}").make_module(
            {"request": request, "login": self.login(request), "prefix": self.keys.prefix})
        return str(module.live(ctx))  # type: ignore[attr-defined]

    def error(self, request: Request, exc: Exception, status: int = 400) -> HTMLResponse:
        return self.render(request, "error.html", status=status, message=str(exc), code=type(exc).__name__)

    # -- the pages' data (shared by the page and its stream) -----------------------------------

    async def overview_data(self, request: Request) -> dict[str, Any]:
        p = request.query_params
        series = history.BY_NAME.get(p.get("range") or "5m")
        if series is None:
            raise BadArgument(f"range is one of {', '.join(history.BY_NAME)}")
        sort = p.get("sort") or "backlog"
        if sort not in dashboard.SORTS:
            raise BadArgument(f"sort is one of {', '.join(dashboard.SORTS)}")
        desc = p.get("order") != "asc"
        self.sampler.want()
        if self.sampler.stale:  # the first look, or the first after the sampler paused
            await self.sampler.sample(self.redis)
        snap = self.sampler.latest
        assert snap is not None
        points = await history.read(self.redis, self.keys, series, snap["now_ms"])
        audit = {name: history.counted_within(points, counter)
                 for name, counter in (("nack", "nacked"), ("timeout", "timeouts"), ("dead_letter", "dead_lettered"),
                                                  ("expired", "expired"))}
        return {"snap": snap, "history": points, "range": series, "ranges": history.SERIES, "audit": audit,
                "start_ms": snap["now_ms"] - series.range_ms, "sort": sort, "desc": desc,
                "busiest": dashboard.sort_rows(snap["busiest"], sort, desc), "error": self.sampler.error}

    async def alarms_data(self, request: Request) -> dict[str, Any]:
        now = await now_ms(self.redis)
        watcher = await self.redis.get(self.keys.health_watcher)
        return {"alarms": await read_alarms(self.redis, self.keys), "now_ms": now,
                "watcher": text(watcher) if watcher is not None else None}

    async def redis_data(self, request: Request) -> dict[str, Any]:
        return {"health": await self.sampler.health(self.redis)}

    async def queues_data(self, request: Request) -> dict[str, Any]:
        p = request.query_params
        kind = p.get("kind") or None
        topic = p.get("topic") or None
        match = p.get("match") or None
        limit = int(p.get("limit") or 50)
        if limit not in PAGE_SIZES:
            raise BadArgument(f"limit is one of {', '.join(map(str, PAGE_SIZES))}")
        sort = p.get("sort") or "name"
        if sort not in SORTS:
            raise BadArgument(f"sort is one of {', '.join(SORTS)}")
        desc = p.get("order") == "desc"
        flt = operations.QueueFilter(kind=kind, topic=topic, match=match)
        page = await operations.list_queues(self.redis, self.keys, flt, limit=limit, cursor=p.get("cursor") or None)
        rows = page.rows

        def key(r: dict[str, Any]) -> tuple[bool, Any]:
            v = r[sort]
            return (v is None, v if v is not None else 0)

        rows.sort(key=key, reverse=desc)
        if desc:  # empty values last either way
            rows.sort(key=lambda r: r[sort] is None)
        base = {k: v for k, v in (("kind", kind), ("topic", topic), ("match", match)) if v}
        return {"rows": rows, "cursor": page.cursor, "filters": base, "sort": sort, "desc": desc, "limit": limit,
                "scanned": page.scanned, "at_cursor": p.get("cursor") or None, "pattern": page.pattern}

    async def queue_data(self, request: Request) -> dict[str, Any]:
        ref = _ref(request.query_params.get("q"))
        q = await inspection.inspect_queue(self.redis, self.keys, ref, limit=50)
        for g in q["groups"]:
            for m in g["members"]:
                m["mode"] = g["mode"]
        return {"q": q, "ref": ref, "levels": _level_rows(q)}

    async def lmqs_data(self, request: Request) -> dict[str, Any]:
        p = request.query_params
        topic, name = (p.get("topic") or "").strip(), (p.get("name") or "").strip()
        out: dict[str, Any] = {"topic": topic, "name": name, "rows": None, "cursor": None, "exact": None}
        if not topic:
            return out
        if name and not any(c in name for c in "*?["):
            # One name among millions: one read of its meta hash, no SCAN.
            rows = await operations.queue_rows(self.redis, self.keys, [QueueRef(topic, name).qid])
            out.update(rows=rows, exact=True)
            return out
        flt = operations.QueueFilter(kind="lite", topic=topic, match=name or None, match_lmq=bool(name))
        page = await operations.list_queues(self.redis, self.keys, flt, limit=50, cursor=p.get("cursor") or None)
        out.update(rows=page.rows, cursor=page.cursor, exact=False)
        return out

    async def sessions_data(self, request: Request) -> dict[str, Any]:
        p = request.query_params
        start = max(0, int(p.get("start") or 0))
        cursor = max(0, int(p.get("cursor") or 0))
        return {"page": await overview.sessions_page(self.redis, self.keys, start=start, limit=50,
                                                     match=p.get("match") or None, cursor=cursor),
                "match": p.get("match") or "", "cursor": cursor}

    async def dlq_data(self, request: Request) -> dict[str, Any]:
        ref = _ref(request.query_params.get("q"))
        start = max(0, int(request.query_params.get("start") or 0))
        res = await maintenance.dead_letters(self.redis, self.keys, ref, limit=20, start=start)
        raw = await self.redis.lrange(self.keys.queue(ref).dead, start, start + 19)
        for e, r in zip(res["dead_letters"], raw, strict=False):
            e["digest"] = overview.dead_letter_digest(r)
            topic = e.get("topic") or ref.topic
            if not self.shows_payload(request, topic):
                e["preview"], e["headers"] = None, None
                e["error"] = f"payload hidden: it needs the subscribe permission on '{topic[:128]}'"
        return {"d": res, "ref": ref, "start": start}


def page_topic(name: str, request: Request) -> str:
    """What a page is about, for the inspect grant it needs: one queue's topic, the topic a list is
    narrowed to, or ``#`` (the whole broker)."""
    p = request.query_params
    if name in ("queue", "dlq"):
        return _ref(p.get("q")).topic
    if name in ("queues", "lmqs"):
        return (p.get("topic") or "").strip() or "#"
    return "#"


def _level_rows(q: dict[str, Any]) -> list[dict[str, Any]]:
    """A priority queue's levels as the queue page lists them (9 first, those holding something or unread by
    some group): the counts ``inspect_queue`` read (ops/inspection.py, fences/priority.py ``level_counts``)."""
    if not q["priority"]:
        return []
    held = q["priority"]["levels"]
    rows = [{"level": lv, "held": held.get(lv, 0),
             "unread": [g.get("unread_by_level", {}).get(lv, 0) for g in q["groups"]]} for lv in LEVELS_SHOWN]
    return [r for r in rows if r["held"] or any(r["unread"])]


def _ref(qid: str | None) -> QueueRef:
    if not qid or qid[:2] not in ("t:", "l:", "f:"):
        raise BadArgument("name a queue by its id (q=t:<topic>, l:<topic>:<lmq> or f:<owner>:<filter>)")
    return queue_ref(qid)


PAGES = {
    "overview": ("overview.html", UI.overview_data),
    "queues": ("queues.html", UI.queues_data),
    "queue": ("queue.html", UI.queue_data),
    "lmqs": ("lmqs.html", UI.lmqs_data),
    "sessions": ("sessions.html", UI.sessions_data),
    "dlq": ("dlq.html", UI.dlq_data),
    "alarms": ("alarms.html", UI.alarms_data),
    "redis": ("redis.html", UI.redis_data),
}
