"""The UI's operator actions (evict, seek, purge, replay, discard): their form fields read and
checked, then done through broker/ops/, as the CLI does them."""

from __future__ import annotations

from typing import Any

from fencemq.errors import BadArgument
from fencemq.model.keys import Keyspace, QueueRef
from fencemq.ops import maintenance, overview


def int_or_none(text: str | None) -> int | None:
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise BadArgument(f"{text[:32]!r} is not a whole number") from None


def action_args(name: str, form: Any) -> dict[str, Any]:
    if name == "evict":
        group, member = str(form.get("group", "")), str(form.get("member", ""))
        if not group or not member:
            raise BadArgument("evict needs a group and a member")
        return {"group": group, "member": member}
    if name == "seek":
        group, kind = str(form.get("group", "")), str(form.get("kind", ""))
        if not group:
            raise BadArgument("seek needs a group")
        if kind not in maintenance.SEEK_KINDS:
            raise BadArgument("seek to id, time, earliest or latest")
        arg = int_or_none(str(form.get("arg", "")))
        if kind in ("id", "time") and arg is None:
            raise BadArgument(f"seek to {kind} needs a value")
        return {"group": group, "kind": kind, "arg": arg if kind in ("id", "time") else None}
    if name == "purge":
        return {}
    if name == "replay":
        count = int_or_none(str(form.get("count", "1"))) or 0
        if not 1 <= count <= 10_000:
            raise BadArgument("replay 1 to 10,000 dead letters")
        return {"count": count}
    position = int_or_none(str(form.get("position", "")))
    if position is None or position < 0 or not str(form.get("digest", "")):
        raise BadArgument("discard needs the position and digest of the dead letter shown")
    return {"position": position, "digest": str(form.get("digest"))}


async def act(r: Any, k: Keyspace, name: str, ref: QueueRef, args: dict[str, Any]) -> dict[str, Any]:
    """Do the confirmed action (the CLI's operator calls)."""
    if name == "evict":
        return await maintenance.evict(r, k, ref, args["group"], args["member"], by="operator")
    if name == "seek":
        return await maintenance.seek(r, k, ref, args["group"], args["kind"], args["arg"])
    if name == "purge":
        return await maintenance.purge(r, k, ref)
    if name == "replay":
        return await maintenance.replay_dead(r, k, ref, count=args["count"])
    return await overview.discard_dead(r, k, ref, args["position"], args["digest"])
