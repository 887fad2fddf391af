"""The web UI: a Starlette app over broker/ops/ (the reads and writes the CLI uses).

Pages are rendered on the server (Jinja2 templates beside this file); each page
opens one server-sent-events stream (``/events``) that sends the page's live
region again, re-rendered, every sampling interval. Writes (evict, seek, purge,
replay, discard) are POSTs that need a login, the user's permission on the
queue's topic, the login's CSRF token and a confirmation (the first POST shows
what will happen; the confirmed one does it).

The UI is a door of the gate (fencemq.server.gate; ui/auth.py says what it asks of it):
logins, grants, the pages' ``inspect`` grant, payloads and the event streams'
connection counts are the gate's answers, turned into HTTP here.

``create_app`` serves ``fencemq dashboard`` and a worker's ``--http-port`` alike.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fencemq.errors import BadArgument, FenceMQError, LimitExceeded, NoPermission, NotFound, WrongPassword
from fencemq.fences.memory import read_alarms
from fencemq.fences.redis_errors import REDIS_FAILURES, redis_failure
from fencemq.model.keys import Keyspace, QueueRef, queue_ref
from fencemq.model.values import text
from fencemq.ops.operations import now_ms
from fencemq.ops.priority import LEVELS_SHOWN
from fencemq.ops import dashboard, history, inspection, maintenance, operations, overview
from fencemq.ops.users import UserStore
from fencemq.server.gate import Gate, Pass
from fencemq.ui import charts, formatting
from fencemq.ui.actions import act, action_args
from fencemq.ui.auth import (
    ACTION_PERMISSION, COOKIE, PREAUTH_FORM_BYTES, SESSION_S, CountedStream, Logins, UIGate, client_address,
    safe_next, small_form,
)
from fencemq.ui.live import Sampler
from fencemq.ui.users import routes as users_routes

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


def create_app(ui: UI) -> Starlette:
    async def page(request: Request, name: str) -> Response:
        template, data = PAGES[name]
        try:
            refusal = await ui.refused(request, page_topic(name, request))
            if refusal is not None:
                return refusal
            ctx = await data(ui, request)
        except NotFound as exc:
            return ui.error(request, exc, 404)
        except (BadArgument, ValueError) as exc:
            return ui.error(request, exc, 400)
        except REDIS_FAILURES as exc:  # Redis failing over: say so, as every door does (TRYAGAIN…)
            return ui.error(request, redis_failure(exc, f"the {name} page"), 503)
        qs = urlencode([(k, v) for k, v in request.query_params.multi_items()])
        return ui.render(request, template, page=name, events=f"/events?{urlencode({'page': name})}"
                         + (f"&{qs}" if qs else ""), c=ctx)

    def route(name: str):
        async def handler(request: Request) -> Response:
            return await page(request, name)
        return handler

    async def events(request: Request) -> Response:
        name = request.query_params.get("page", "")
        if name not in LIVE_PAGES:
            return PlainTextResponse("page is one of " + ", ".join(LIVE_PAGES), status_code=400)
        template, data = PAGES[name]
        try:
            refusal = await ui.refused(request, page_topic(name, request))
        except (BadArgument, ValueError) as exc:
            return PlainTextResponse(str(exc), status_code=400)
        if refusal is not None:
            return refusal
        login = ui.login(request)
        assert ui.gate is not None
        gate = ui.gate
        # An event stream is a connection held open: the gate counts it with the worker's others.
        try:
            gate_pass = gate.enter("ui", client_address(request))
        except LimitExceeded as exc:
            return PlainTextResponse(f"{exc.message}; try again later", status_code=503)
        try:
            gate.admit(gate_pass, login.user if login else None)
        except LimitExceeded as exc:
            gate.leave(gate_pass)
            return PlainTextResponse(exc.message, status_code=429)

        async def stream() -> AsyncIterator[bytes]:
            version = ui.sampler.version
            yield f"retry: {int(ui.interval * 1000)}\n\n".encode()
            while True:
                if name == "overview":
                    with anyio.move_on_after(max(ui.interval * 3, 5)):
                        version = await ui.sampler.wait_newer(version)
                else:
                    await anyio.sleep(ui.interval)
                if await request.is_disconnected():
                    return
                if login is not None and await ui.resolve(request) is None:
                    yield b"event: gone\ndata: your login ended; log in again\n\n"
                    return
                try:
                    html = ui.fragment(template, request, **await data(ui, request))
                    event = "live"
                except (FenceMQError, ValueError) as exc:
                    html, event = str(exc), "gone"
                except REDIS_FAILURES as exc:  # Redis away: say so, keep the stream
                    html, event = redis_failure(exc, f"the {name} page").resp(), "trouble"
                except Exception as exc:  # noqa: BLE001 - whatever else: say so, keep the stream
                    html, event = f"{type(exc).__name__}: {exc}", "trouble"
                payload = "".join(f"data: {line}\n" for line in html.splitlines() or [""])
                yield f"event: {event}\n{payload}\n".encode()

        return CountedStream(stream(), gate, gate_pass, media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def login_page(request: Request) -> Response:
        if request.method == "GET":
            return ui.render(request, "login.html", page="login", next=safe_next(request.query_params.get("next")))
        assert ui.gate is not None
        form = await small_form(request, ui.gate.preauth_max_bytes or PREAUTH_FORM_BYTES)
        if form is None:
            return ui.error(request, BadArgument("a login form is a user name and a password, and this one is too "
                                                 "large; nothing was read of it"), 413)
        name, password = form.get("user", ""), form.get("password", "")
        nxt = safe_next(form.get("next", ""))
        try:  # the gate's log_in: throttled per address, as AUTH and CONNECT are
            user = await ui.gate.log_in(Pass("ui", client_address(request)), name or None, password.encode())
        except WrongPassword:
            return ui.render(request, "login.html", status=401, page="login", next=nxt, user=name,
                             failed="Wrong user name or password.")
        token = ui.logins.start(user)
        resp = RedirectResponse(nxt, status_code=303)
        resp.set_cookie(COOKIE, token, max_age=SESSION_S, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
        return resp

    async def logout(request: Request) -> Response:
        login = await ui.resolve(request)
        form = await request.form() if login is not None else await small_form(request, PREAUTH_FORM_BYTES) or {}
        if login is not None and not login.csrf_ok(form.get("csrf")):
            return ui.error(request, BadArgument("the form's CSRF token does not match your login"), 403)
        ui.logins.end(request.cookies.get(COOKIE))
        resp = RedirectResponse("/", status_code=303)
        resp.delete_cookie(COOKIE)
        return resp

    async def action(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ("evict", "seek", "purge", "replay", "discard"):
            return ui.error(request, NotFound(f"no action {name[:32]!r}"), 404)
        posted = await ui.posted_form(request, lambda form: safe_next(str(form.get("back"))),
                                      "Log in as a FenceMQ user with the operator permission to do that.")
        if isinstance(posted, Response):
            return posted
        login, form = posted
        try:
            ref = _ref(str(form.get("q", "")))
            assert ui.gate is not None
            ui.gate.check(login.user, ACTION_PERMISSION[name], ref.topic)  # the one matcher, as at every door
            args = action_args(name, form)
            page_of = "/dlq" if name in ("replay", "discard") else "/queue"
            back = safe_next(str(form.get("back", "")) or f"{page_of}?{urlencode({'q': ref.qid})}")
            if form.get("confirmed") != "yes":
                return ui.render(request, "confirm.html", page="confirm", action=name, ref=ref, args=args,
                                 back=back, fields=[(k, v) for k, v in form.multi_items() if k not in ("csrf",)])
            result = await act(ui.redis, ui.keys, name, ref, args)
        except NoPermission as exc:
            return ui.error(request, exc, 403)
        except NotFound as exc:
            return ui.error(request, exc, 404)
        except (BadArgument, ValueError) as exc:
            return ui.error(request, exc, 400)
        except REDIS_FAILURES as exc:  # Redis failing over: say so, as every door does (TRYAGAIN…)
            return ui.error(request, redis_failure(exc, f"the {name} page"), 503)
        return ui.render(request, "done.html", page="done", action=name, ref=ref, args=args, back=back,
                         result=json.dumps(result, indent=2, default=str))

    async def metrics(_request: Request) -> Response:
        # the process's Prometheus metrics beside the pages: a worker's own with `serve --http-port`
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    users_page, user_change = users_routes(ui)
    routes = [
        Route("/", route("overview")),
        Route("/users", users_page),
        Route("/users/{op}", user_change, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/queues", route("queues")),
        Route("/queue", route("queue")),
        Route("/lmqs", route("lmqs")),
        Route("/sessions", route("sessions")),
        Route("/dlq", route("dlq")),
        Route("/alarms", route("alarms")),
        Route("/redis", route("redis")),
        Route("/events", events),
        Route("/login", login_page, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/action/{name}", action, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        own = ui.redis is None
        if own:
            from fencemq.fences.redis_client import open_redis

            ui.redis = await open_redis(ui.redis_url)
        own_gate = ui.gate is None
        if own_gate:
            ui.gate = ui.own_gate()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ui.sampler.run, ui.redis)
                yield
                tg.cancel_scope.cancel()
        finally:
            if own_gate:
                ui.gate = None
            with anyio.CancelScope(shield=True):
                await ui.sampler.aclose()
            if own:
                await ui.redis.aclose()
                ui.redis = None

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.ui = ui
    return app
