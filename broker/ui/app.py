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
from urllib.parse import urlencode

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from fencemq.errors import BadArgument, FenceMQError, LimitExceeded, NoPermission, NotFound, WrongPassword
from fencemq.fences.redis_errors import REDIS_FAILURES, redis_failure
from fencemq.server.gate import Pass
from fencemq.ui.actions import act, action_args
from fencemq.ui.auth import (
    ACTION_PERMISSION, COOKIE, PREAUTH_FORM_BYTES, SESSION_S, CountedStream, client_address,
    safe_next, small_form,
)
from fencemq.ui.users import routes as users_routes

from fencemq.ui.pages import HERE, LIVE_PAGES, PAGES, UI, _ref, page_topic


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
