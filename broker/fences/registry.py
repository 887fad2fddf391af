"""The fence registry: loads ``lua/*.lua`` (shipped as package ``fencemq.lua``).

A script may pull shared helpers in with a line ``--@include _common.lua``;
files starting with ``_`` are helpers, not fences. Each fence is wrapped in a
redis-py ``Script``: it runs by EVALSHA and, after a restart or SCRIPT FLUSH
answers NOSCRIPT, is loaded again transparently — clients never see it.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from fencemq.errors import FenceMQError, translate

_INCLUDE = re.compile(r"^--@include\s+(\S+)\s*$", re.MULTILINE)


@cache
def sources() -> dict[str, str]:
    """Fence name -> full Lua source with its includes expanded."""
    package = resources.files("fencemq.lua")
    raw = {p.name: p.read_text(encoding="utf-8") for p in package.iterdir() if p.name.endswith(".lua")}

    def expand(name: str, seen: tuple[str, ...] = ()) -> str:
        if name in seen:
            raise RuntimeError(f"include cycle: {' -> '.join(seen + (name,))}")
        if name not in raw:
            raise RuntimeError(f"lua/{seen[-1] if seen else '?'} includes missing file {name}")
        return _INCLUDE.sub(lambda m: expand(m.group(1), seen + (name,)), raw[name])

    return {name[:-4]: expand(name) for name in raw if not name.startswith("_")}


class Fences:
    """Every fence, bound to one async redis client.

    ``await fences.call("pull", keys, args)`` runs a fence and turns its coded
    errors into FenceMQError subclasses.
    """

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.scripts: dict[str, AsyncScript] = {
            name: redis.register_script(src) for name, src in sources().items()
        }

    async def call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.scripts[name](keys=keys, args=args)
        except ResponseError as exc:
            mapped = translate(exc)
            if mapped is not None:
                raise mapped from None
            raise

    @staticmethod
    def check(result: Any) -> Any:
        """For pipeline results (raise_on_error=False): raise a fence's coded error."""
        if isinstance(result, ResponseError):
            mapped = translate(result)
            raise mapped if mapped is not None else result
        if isinstance(result, FenceMQError):
            raise result
        return result
