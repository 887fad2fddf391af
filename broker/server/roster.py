"""This worker's connections and counts, as INFO and CLIENT LIST tell them.

The worker's services hold one roster; every session enters it when its
connection opens and leaves it when the connection closes. Nothing here
touches Redis or a socket: it is what a worker knows of itself.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


class Session(Protocol):
    """What the roster reads of a session (fencemq.server.session.Session; named apart, no import circle)."""

    token: str
    bound: bool
    client_id: str | None

    def __getattr__(self, name: str) -> Any: ...


class Roster:
    def __init__(self) -> None:
        self.started = time.time()
        self.sessions: dict[str, Session] = {}  # by connection token
        self.connections_received = 0
        self.commands_processed = 0

    def enter(self, session: Session) -> None:
        self.sessions[session.token] = session
        self.connections_received += 1

    def leave(self, session: Session) -> None:
        self.sessions.pop(session.token, None)

    def sharing(self, session: Session) -> list[Session]:
        """The connections on this worker that act for the session's client (itself first)."""
        others = [s for s in self.sessions.values()
                  if s is not session and s.bound and s.client_id == session.client_id]
        return [session, *others] if session.client_id is not None else [session]
