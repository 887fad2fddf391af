"""The help text of every `fencemq` command, as written: no type noise, literal text kept literal.

Typer renders help through rich: it shows a type beside every option (``<bool>`` beside a flag,
``<str>`` beside a name) and reads help strings as rich markup, so ``pip install 'fencemq[fast]'``
lost its ``[fast]``. ``HelpGroup`` is the root app's click group: when typer builds the command tree
it walks it once, escapes every help string (help is text, never markup) and shows a value's kind
only where it says something (``N`` for a number, ``PATH``, the option's own name for text, the
choices of a choice, the metavar where one is given; nothing for a flag or beside an argument, whose
name is shown already).
"""

from __future__ import annotations

from types import MethodType
from typing import Any

from rich.markup import escape
from typer.core import TyperArgument, TyperGroup

NUMBER_TYPES = {"int", "int range", "float", "float range"}


def value_label(param: Any, typer_label: str | None) -> str:
    """What the help shows beside ``param`` where typer would show ``typer_label`` (e.g. ``<int range>``)."""
    if isinstance(param, TyperArgument):
        return ""  # its name column says it
    if param.metavar is not None:
        return param.metavar
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    kind = (typer_label or "").strip("<>")
    if kind in NUMBER_TYPES:
        return "N"
    if kind == "path":
        return "PATH"
    if kind in ("str", "list[str]", ""):
        long_names = [o for o in param.opts if o.startswith("--")]
        return (long_names[0][2:] if long_names else param.name or "value").upper().replace("-", "_")
    return kind  # e.g. the choices of a choice, a|b|c


def _tidy_param(param: Any) -> None:
    if getattr(param, "_fencemq_tidy", False):
        return
    param._fencemq_tidy = True
    if getattr(param, "help", None):
        param.help = escape(param.help)
    shown = param.display_type_rich

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        return value_label(self, shown(ctx=ctx))

    param.display_type_rich = MethodType(display_type_rich, param)


def tidy(command: Any) -> None:
    """Escape the help of ``command`` and of everything under it; quiet its parameters' types."""
    if getattr(command, "_fencemq_tidy", False):
        return
    command._fencemq_tidy = True
    for attr in ("help", "short_help", "epilog"):
        if getattr(command, attr, None):
            setattr(command, attr, escape(getattr(command, attr)))
    for param in command.params:
        _tidy_param(param)
    # --help is made on first use and kept (click caches it): make it now, to tidy it too
    help_option = command.get_help_option(command.context_class(command))
    if help_option is not None:
        _tidy_param(help_option)
    for sub in getattr(command, "commands", {}).values():
        tidy(sub)


class HelpGroup(TyperGroup):
    """The root `fencemq` group: its whole tree's help tidied as it is built (see the module doc)."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        tidy(self)
