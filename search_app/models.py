"""The search index over what was said in sessions (docs/behaviour.md §12, "Search").

Derived from the transcripts, never the other way round: a :class:`Passage` is one user
message or one reply as the session page shows it (the same start seq, so a result links
to the page's own anchor), and :class:`Indexed` says how far a session's transcript has
been read into passages. Deleting either loses nothing: they are read again
(sessions_app.transcript stays the memory). The full-text index itself lives in the
database (an FTS5 table on SQLite, a GIN index on PostgreSQL: search_app/migrations).
"""

from __future__ import annotations

from django.db import models

from sessions_app.models import AgentSession


class Passage(models.Model):
    """One message as said: ``role`` ``user`` (a ``message_taken``, anchor ``ev-<seq>``)
    or ``assistant`` (a run of ``assistant_text``, anchor ``a-<seq>``); ``seq`` the first
    event, ``last_seq`` the last one folded in; ``who`` the sender's username (users)."""

    class Role(models.TextChoices):
        USER = "user", "user"
        ASSISTANT = "assistant", "assistant"

    session = models.ForeignKey(AgentSession, on_delete=models.CASCADE, related_name="passages")
    seq = models.PositiveBigIntegerField()
    last_seq = models.PositiveBigIntegerField()
    role = models.CharField(max_length=10, choices=Role.choices)
    who = models.CharField(max_length=150, blank=True)
    text = models.TextField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["session", "seq"], name="one_passage_per_start")]

    @property
    def anchor(self) -> str:
        """The id of this message's element on the session page."""
        return f"ev-{self.seq}" if self.role == self.Role.USER else f"a-{self.seq}"


class Indexed(models.Model):
    """How far a session's transcript has been read into passages: every event up to seq
    ``upto``; ``open_passage`` is the reply that may go on with the next events."""

    session = models.OneToOneField(AgentSession, on_delete=models.CASCADE, primary_key=True, related_name="search_index")
    upto = models.PositiveBigIntegerField(default=0)
    open_passage = models.ForeignKey(Passage, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
