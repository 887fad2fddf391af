"""MQTT topic names and filters: validation, matching, and an index for fan-out.

Rules (MQTT 5.0 §4.7): levels are separated by '/'; '+' matches one level,
'#' the rest and only as the last level; wildcards stand alone in a level and
never appear in a published name; a topic starting with '$' is not matched by
a filter whose first level is a wildcard. Names are UTF-8 without NUL.
Shared subscriptions are ``$share/<ShareName>/<filter>`` (§4.8.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fencemq.errors import BadArgument

MAX_TOPIC_BYTES = 512
SHARE_PREFIX = "$share/"


def _check_text(text: str, what: str) -> None:
    if not text:
        raise BadArgument(f"{what} is empty; MQTT names have at least one character")
    if "\x00" in text:
        raise BadArgument(f"{what} contains NUL, which MQTT forbids")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TOPIC_BYTES:
        raise BadArgument(f"{what} is longer than {MAX_TOPIC_BYTES} bytes")


def has_wildcard(text: str) -> bool:
    return "+" in text or "#" in text


def check_topic_name(name: str) -> str:
    """A name messages are published to: no wildcards."""
    _check_text(name, "topic name")
    if has_wildcard(name):
        raise BadArgument(f"topic name '{name}' contains '+' or '#'; wildcards belong in filters, not in names")
    return name


def check_filter(text: str) -> str:
    _check_text(text, "topic filter")
    levels = text.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise BadArgument(f"topic filter '{text}': '#' must be a whole level and the last one")
        if "+" in level and level != "+":
            raise BadArgument(f"topic filter '{text}': '+' must be a whole level")
    return text


@dataclass(frozen=True, slots=True)
class FilterTarget:
    """What a SUB target names: a filter, shared under ``share`` or not."""

    filter: str
    share: str | None = None


def parse_target(target: str) -> FilterTarget:
    check_share_syntax(target)
    if target.startswith(SHARE_PREFIX):
        share, sep, filt = target[len(SHARE_PREFIX):].partition("/")
        if not share:
            raise BadArgument("shared subscription must be $share/<ShareName>/<filter>; the ShareName is empty")
        if not sep or not filt:
            raise BadArgument("shared subscription must be $share/<ShareName>/<filter>; the filter is missing")
        if has_wildcard(share) or "/" in share:
            raise BadArgument(f"ShareName '{share}' may not contain '/', '+' or '#'")
        return FilterTarget(check_filter(filt), share)
    return FilterTarget(check_filter(target))


def check_share_syntax(target: str) -> None:
    """``$share:g:filter`` (the colon form of the MQTT-234 discussion) is not a topic: say what to write."""
    if target.startswith("$share:"):
        group, _, filt = target[len("$share:"):].partition(":")
        raise BadArgument(f"shared subscriptions are written $share/<group>/<filter>, e.g. $share/{group or 'g'}/"
                          f"{filt or '<filter>'}; '$share:' is not a topic")


def matches(filt: str, topic: str) -> bool:
    f_levels, t_levels = filt.split("/"), topic.split("/")
    if topic.startswith("$") and f_levels[0] in ("+", "#"):
        return False
    for i, level in enumerate(f_levels):
        if level == "#":
            return True
        if i >= len(t_levels) or (level != "+" and level != t_levels[i]):
            return False
    return len(f_levels) == len(t_levels)


@dataclass
class _Node:
    children: dict[str, "_Node"] = field(default_factory=dict)
    here: set[str] = field(default_factory=set)  # entries whose filter ends at this node
    rest: set[str] = field(default_factory=set)  # entries whose filter ends with '#' here


class FilterIndex:
    """A trie of filters: matching a topic costs O(levels · branching), not O(filters)."""

    def __init__(self) -> None:
        self.root = _Node()
        self.filters: dict[str, str] = {}  # entry -> filter

    def __len__(self) -> int:
        return len(self.filters)

    def add(self, entry: str, filt: str) -> None:
        self.remove(entry)
        node = self.root
        levels = filt.split("/")
        for level in levels:
            if level == "#":
                node.rest.add(entry)
                break
            node = node.children.setdefault(level, _Node())
        else:
            node.here.add(entry)
        self.filters[entry] = filt

    def remove(self, entry: str) -> None:
        filt = self.filters.pop(entry, None)
        if filt is None:
            return
        node = self.root
        for level in filt.split("/"):
            if level == "#":
                node.rest.discard(entry)
                return
            node = node.children.get(level)
            if node is None:
                return
        node.here.discard(entry)

    def match(self, topic: str) -> set[str]:
        levels = topic.split("/")
        found: set[str] = set()
        dollar = topic.startswith("$")

        def walk(node: _Node, i: int) -> None:
            wild_ok = not (dollar and i == 0)
            if wild_ok:
                found.update(node.rest)
            if i == len(levels):
                found.update(node.here)
                return
            child = node.children.get(levels[i])
            if child is not None:
                walk(child, i + 1)
            if wild_ok and "+" in node.children:
                walk(node.children["+"], i + 1)

        walk(self.root, 0)
        return found
