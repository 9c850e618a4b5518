"""Versions of a message sent again (docs/transcript.md, "Versions"): :class:`Versions`,
the fold the page and the actions use to say which version of a message is shown.

This module must not import Django.
"""

from __future__ import annotations

from typing import Any

from .reading import _CLEARED, _MESSAGE_TAKEN, _VERSION_CHOSEN, _payload
from .vocabulary import EventLike


class Versions:
    """Which user messages are versions of one another, and which version is shown
    (docs/transcript.md, "Versions"): a fold over ``message_taken``, ``version_chosen`` and
    ``cleared`` events (others are ignored), fed in seq order, each event once (one at or
    below the last seq fed is skipped, so a fold fed ahead can be fed a window again).

    A message sent again (``replaces``) joins the group of the message it replaces — the
    group's first message is its root — and becomes the version in force; a
    ``version_chosen`` makes an earlier one the version in force. As in
    :func:`build_messages`, a message before the last ``cleared`` starts no group.
    Everything a group's messages started (the exchange: the message and what followed it
    up to the next message) shows only for the version in force.
    """

    def __init__(self) -> None:
        self.root_of: dict[int, int] = {}
        self.members: dict[int, list[int]] = {}
        self.chosen: dict[int, int] = {}
        self.live: set[int] = set()  # messages after the last cleared
        self.upto = 0

    def feed(self, event: EventLike) -> tuple[int, int] | None:
        """Fold one event; ``(hidden, shown)`` — the exchanges whose showing changed —
        when it changed which version of a group is in force, else None."""
        if event.seq <= self.upto:
            return None
        self.upto = event.seq
        payload = _payload(event)
        if event.kind == _CLEARED:
            self.live = set()
        elif event.kind == _MESSAGE_TAKEN:
            replaces = payload.get("replaces")
            root = self.root_of[replaces] if isinstance(replaces, int) and replaces in self.live else event.seq
            self.root_of[event.seq] = root
            self.members.setdefault(root, []).append(event.seq)
            self.live.add(event.seq)
            before = self.chosen.get(root)
            self.chosen[root] = event.seq
            if before is not None and before != event.seq:
                return before, event.seq
        elif event.kind == _VERSION_CHOSEN:
            seq = payload.get("seq")
            if isinstance(seq, int) and seq in self.live:
                root = self.root_of[seq]
                before = self.chosen[root]
                self.chosen[root] = seq
                if before != seq:
                    return before, seq
        return None

    def hidden(self, exchange: int | None) -> bool:
        """Whether what the exchange started by message ``exchange`` shows: not when
        another version of its group is in force."""
        root = self.root_of.get(exchange) if exchange is not None else None
        return root is not None and self.chosen[root] != exchange

    def group(self, seq: int) -> list[int]:
        """The versions of the message ``seq`` (itself included), oldest first."""
        root = self.root_of.get(seq)
        return list(self.members[root]) if root is not None else []

    def pager(self, seq: int) -> dict[str, Any] | None:
        """``{"index", "total", "previous", "next"}`` (1-based index; neighbours' seqs or
        None) for a message with more than one version, else None."""
        members = self.group(seq)
        if len(members) < 2:
            return None
        index = members.index(seq)
        return {"index": index + 1, "total": len(members),
                "previous": members[index - 1] if index else None,
                "next": members[index + 1] if index + 1 < len(members) else None}
