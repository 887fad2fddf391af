"""Users and grants in the UI: list, add, grant, revoke, remove — the CLI's operator layer
(fencemq.ops.users.UserStore, as ``fencemq user`` uses it), behind the ``admin`` grant.

The page and every change need a login whose user may ``admin`` (on ``#``), asked of the gate's one
matcher as every door asks it; a change is a POST with the login's CSRF token, shown first as a
confirmation and done only when confirmed, and written to the log (``fencemq.audit``: who, from
where, what). A changed user's connections are updated or ended by every worker at once, as after
the CLI's change (the store announces it).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from fencemq.errors import BadArgument, FenceMQError, NoPermission, NotFound
from fencemq.fences.redis_errors import REDIS_FAILURES, redis_failure
from fencemq.ops.users import ACTIONS, ALL, UserStore, check_action, check_password, check_user_name
from fencemq.model.topics import check_filter
from fencemq.ui.auth import client_address, safe_next

audit = logging.getLogger("fencemq.audit")
CHANGES = ("add", "grant", "revoke", "remove")
GRANTABLE = (*ACTIONS, ALL)


def parse_grants(text: str) -> list[tuple[str, str]]:
    """``action:filter`` pairs, one per line or separated by spaces (``publish:orders/#``)."""
    out = []
    for item in text.replace(",", " ").split():
        action, sep, filt = item.partition(":")
        if not sep or not filt:
            raise BadArgument(f"a grant is action:filter (publish:orders/#), not {item[:64]!r}")
        out.append((check_action(action), check_filter(filt)))
    return out


def change_args(op: str, form: Any) -> dict[str, Any]:
    """The change's fields, checked before anything is shown or done."""
    name = check_user_name(str(form.get("user", "")))
    if op == "add":
        password = str(form.get("password", ""))
        check_password(password)
        return {"user": name, "password": password, "grants": parse_grants(str(form.get("grants", "")))}
    if op in ("grant", "revoke"):
        action = check_action(str(form.get("action", "")))
        filt = str(form.get("filter", "")).strip()
        check_filter(filt)
        return {"user": name, "action": action, "filter": filt}
    return {"user": name}


def describe(op: str, args: dict[str, Any]) -> str:
    grants = ", ".join(f"{a}:{f}" for a, f in args.get("grants", [])) or "no grant"
    return {"add": f"add user '{args['user']}' with {grants}",
            "grant": f"grant '{args['user']}' {args.get('action')} on '{args.get('filter')}'",
            "revoke": f"revoke {args.get('action')} on '{args.get('filter')}' from '{args['user']}'",
            "remove": f"remove user '{args['user']}'"}[op]


async def apply(store: UserStore, op: str, args: dict[str, Any]) -> None:
    if op == "add":
        await store.add(args["user"], args["password"], args["grants"])
    elif op == "grant":
        await store.grant(args["user"], args["action"], args["filter"])
    elif op == "revoke":
        await store.revoke(args["user"], args["action"], args["filter"])
    elif not await store.delete(args["user"]):
        raise NotFound(f"no user '{args['user']}'")


def routes(ui: Any) -> tuple[Any, Any]:
    """The users page (GET /users) and a change (POST /users/{op}), over ``ui`` (fencemq.ui.app.UI)."""

    async def admin_login(request: Request) -> tuple[Any, Response | None]:
        refusal = await ui.refused(request, "#")
        if refusal is not None:
            return None, refusal
        login = ui.login(request)
        user = login.user if login is not None else None
        try:
            ui.gate.check(user, "admin", "#")  # the one matcher, as at every door
        except NoPermission as exc:
            return None, ui.error(request, exc, 403)
        return login, None

    async def page(request: Request) -> Response:
        login, refusal = await admin_login(request)
        if refusal is not None:
            return refusal
        try:
            users = await ui.users.list()
        except REDIS_FAILURES as exc:
            return ui.error(request, redis_failure(exc, "the users page"), 503)
        return ui.render(request, "users.html", page="users", users=users, actions=GRANTABLE,
                         no_users=not users, can_change=login is not None)

    async def change(request: Request) -> Response:
        op = request.path_params["op"]
        if op not in CHANGES:
            return ui.error(request, NotFound(f"no change {op[:32]!r}"), 404)
        posted = await ui.posted_form(request, lambda _: "/users",
                                      "Log in as a FenceMQ user with the admin permission to manage users.")
        if isinstance(posted, Response):
            return posted
        login, form = posted
        try:
            ui.gate.check(login.user, "admin", "#")
            args = change_args(op, form)
            if form.get("confirmed") != "yes":
                shown = [(k, v) for k, v in form.multi_items() if k not in ("csrf", "confirmed")]
                first = op == "add" and not await ui.users.any()
                return ui.render(request, "user_confirm.html", page="users", op=op, what=describe(op, args),
                                 fields=shown, first_user=first, self_change=args["user"] == login.user.name)
            await apply(ui.users, op, args)
        except NoPermission as exc:
            return ui.error(request, exc, 403)
        except NotFound as exc:
            return ui.error(request, exc, 404)
        except (BadArgument, ValueError) as exc:
            return ui.error(request, exc, 400)
        except REDIS_FAILURES as exc:
            return ui.error(request, redis_failure(exc, "the users page"), 503)
        except FenceMQError as exc:
            return ui.error(request, exc, 400)
        audit.warning("audit: web UI user '%s' from %s: %s", login.user.name, client_address(request) or "?",
                      describe(op, args))
        return ui.render(request, "done.html", page="users", action=op, ref=f"user '{args['user']}'",
                         back=safe_next("/users"), result=describe(op, args) + ": done")

    return page, change
