"""Full-text search over what was said in the sessions a person may see.

:func:`find` answers a query with the passages (user messages and replies) that contain
every word of it, newest first, each with a snippet and the link to its place on the
session page. It reads the index the database keeps: PostgreSQL's full-text search
(``websearch_to_tsquery('simple', …)`` against a GIN index on ``to_tsvector('simple',
text)``), or SQLite's FTS5 on the embedded default (search_app/migrations). Whole words,
any case; ``simple`` stems nothing, so a word is found in any language as written.

Who may see a result is decided where every list of sessions decides it
(``AgentSession.objects.visible_to``): the query runs over those sessions only.

The index is derived from the transcripts (:func:`catch_up`): before answering, the
sessions whose transcript has grown since they were read are read on from where they
stopped, so what was said a moment ago is found, with no step added to the path that
writes events.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.db import IntegrityError, connection, transaction
from django.db.models import F, QuerySet, Value
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce
from django.urls import reverse

from sessions_app.live.items import NOTE_KINDS, QUEUE_KINDS, SILENT_KINDS, TOOL_KINDS
from sessions_app.models import AgentSession, TranscriptEvent
from sessions_app.transcript import Kind, actor

from .models import Indexed, Passage

__all__ = ["MAX_RESULTS", "Found", "catch_up", "find", "index_session"]

#: How many passages one search lists (newest first).
MAX_RESULTS = 50
#: Characters of context a snippet shows around the first word found.
SNIPPET_BEFORE, SNIPPET_AFTER = 60, 160
#: Events read per query while catching up a long transcript.
CHUNK = 2000

#: Kinds that leave a reply open on the page (sessions_app.live.transcript_view.TranscriptView):
#: the reply's later text joins the same bubble, so the same passage.
_KEEP_OPEN = SILENT_KINDS | QUEUE_KINDS | NOTE_KINDS | (TOOL_KINDS - {Kind.TOOL_START}) | {Kind.ALLOWANCE_REVOKED}


def index_session(session_id: int) -> None:
    """Read the session's events after its :class:`Indexed` mark into passages.

    A ``message_taken`` is one user passage (its text, its sender); a run of
    ``assistant_text`` is one assistant passage, cut where the page cuts the reply's
    bubble. Runs under the mark's row lock, so two searches never read the same events
    twice."""
    for _attempt in range(2):
        try:
            with transaction.atomic():
                mark, _ = Indexed.objects.select_for_update().get_or_create(session_id=session_id)
                _read_on(mark)
            return
        except IntegrityError:
            continue  # another search made the mark first: read on under its lock


def _read_on(mark: Indexed) -> None:
    passage = mark.open_passage
    dirty = False  # the open passage grew since it was last saved

    def close() -> None:
        # One write per passage per read, not one per fragment: a reply streamed as 3,000
        # fragments rewrote its whole passage (and its full-text row) 3,000 times.
        if passage is not None and dirty:
            passage.save(update_fields=["text", "last_seq"])

    events = (TranscriptEvent.objects.filter(session_id=mark.session_id, seq__gt=mark.upto)
              .order_by("seq").only("seq", "kind", "payload"))
    for event in events.iterator(chunk_size=CHUNK):
        kind, payload = event.kind, event.payload if isinstance(event.payload, dict) else {}
        if kind == Kind.ASSISTANT_TEXT:
            text = payload.get("text") or ""
            if passage is None:
                passage = Passage.objects.create(session_id=mark.session_id, seq=event.seq, last_seq=event.seq,
                                                 role=Passage.Role.ASSISTANT, text=text)
            else:
                passage.text += text
                passage.last_seq = event.seq
                dirty = True
        elif kind in _KEEP_OPEN:
            pass
        else:
            close()
            passage, dirty = None, False
            if kind == Kind.MESSAGE_TAKEN and isinstance(payload.get("text"), str) and payload["text"].strip():
                who = actor(payload)
                Passage.objects.create(session_id=mark.session_id, seq=event.seq, last_seq=event.seq,
                                       role=Passage.Role.USER, who=who["username"] if who else "",
                                       text=payload["text"])
        mark.upto = event.seq
    close()
    mark.open_passage = passage
    mark.save()


def catch_up(sessions: QuerySet[AgentSession]) -> None:
    """Index every session of ``sessions`` whose transcript grew since it was read."""
    behind = (sessions.annotate(read=Coalesce(F("search_index__upto"), Value(0)))
              .filter(last_seq__gt=F("read")).values_list("pk", flat=True))
    for session_id in list(behind):
        index_session(session_id)


@dataclass
class Found:
    """One passage found: its session, who said it (``"the model"`` for a reply), the
    snippet as ``[(text, is_match), …]`` and the URL of its place on the session page."""

    session: AgentSession
    passage: Passage
    who: str
    snippet: list[tuple[str, bool]]
    url: str


def _words(query: str) -> list[str]:
    """The words of a query as the index splits them (letters and digits)."""
    return [w for w in re.findall(r"\w+", query.lower()) if w]


def _matching(passages: QuerySet[Passage], query: str) -> QuerySet[Passage]:
    if connection.vendor == "postgresql":
        from django.contrib.postgres.search import SearchQuery, SearchVector

        vector = SearchVector("text", config="simple")  # the indexed expression (search_app/migrations)
        return passages.annotate(found=vector).filter(found=SearchQuery(query, config="simple", search_type="websearch"))
    if connection.vendor == "sqlite":
        # Every word as an FTS5 string (quotes doubled): a query is never read as FTS5 syntax.
        match = " ".join('"' + word.replace('"', '""') + '"' for word in _words(query))
        return passages.filter(id__in=RawSQL("SELECT rowid FROM search_app_passage_fts WHERE search_app_passage_fts MATCH %s",
                                             [match]))
    # Any other database: every word as a substring (no index).
    for word in _words(query):
        passages = passages.filter(text__icontains=word)
    return passages


def snippet(text: str, query: str) -> list[tuple[str, bool]]:
    """A window of ``text`` around the first word of ``query`` found, split into
    ``(part, is_match)`` pieces (every whole-word occurrence of a query word marked)."""
    words = _words(query)
    if not words:
        return [(text[:SNIPPET_AFTER], False)]
    pattern = re.compile(r"(?<!\w)(" + "|".join(re.escape(w) for w in words) + r")(?!\w)", re.IGNORECASE)
    first = pattern.search(text)
    start = max(0, first.start() - SNIPPET_BEFORE) if first else 0
    end = min(len(text), (first.end() if first else 0) + SNIPPET_AFTER)
    window = " ".join(text[start:end].split())
    pieces: list[tuple[str, bool]] = [("…", False)] if start else []
    at = 0
    for match in pattern.finditer(window):
        if match.start() > at:
            pieces.append((window[at:match.start()], False))
        pieces.append((match.group(0), True))
        at = match.end()
    if at < len(window):
        pieces.append((window[at:], False))
    if end < len(text):
        pieces.append(("…", False))
    return pieces


def find(sessions: QuerySet[AgentSession], query: str, *, limit: int = MAX_RESULTS) -> list[Found]:
    """The passages of ``sessions`` (already narrowed to what the person may see:
    ``AgentSession.objects.visible_to``) containing every word of ``query``, newest
    first, at most ``limit``. ``[]`` for a query with no word."""
    if not _words(query):
        return []
    catch_up(sessions)
    passages = _matching(Passage.objects.filter(session__in=sessions.values("pk")), query)
    found = []
    for passage in passages.select_related("session").order_by("-id")[:limit]:
        url = reverse("session_detail", args=[passage.session_id]) + f"?at={passage.seq}#{passage.anchor}"
        who = passage.who or "someone" if passage.role == Passage.Role.USER else "the model"
        found.append(Found(passage.session, passage, who, snippet(passage.text, query), url))
    return found
