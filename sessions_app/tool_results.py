"""The bound on a tool result on its way to the model and into the transcript
(docs/behaviour.md §9, "Results are bounded").

A result is sent again with every later request of the conversation, so one 30 MB answer
(an MCP server's, a command's) would be stored, pushed to every watcher and leave the
session stuck in context overflow for good. :func:`cap` keeps its start and its end (a
command's exit code is there) and says, in its place, how much was cut and how to ask for
a part. Plain Python, no Django import; the limit is the caller's
(``CORRAL_TOOL_RESULT_MAX_CHARS``).
"""

from __future__ import annotations

__all__ = ["CUT_NOTE", "cap"]

#: Stands where the middle of a result was cut; ``.format(cut=, total=, limit=)``.
CUT_NOTE = (
    "\n\n[Corral cut {cut:,} of this result's {total:,} characters here: a tool result sent to the model is at "
    "most {limit:,} characters. Ask for the part you need: read_file with start_line/end_line, a narrower "
    "grep_search (path, include, pattern), a command whose output is smaller (head, tail, sed -n 'a,bp', grep), "
    "or narrower arguments to this tool.]\n\n"
)
#: Share of the kept characters taken from the end of the result.
TAIL_SHARE = 0.25


def cap(output: str, limit: int) -> tuple[str, int | None]:
    """``output`` cut to at most about ``limit`` characters (plus the note), and its full
    length in characters — None when it was not cut.

    The first three quarters of the kept characters come from the start, the last quarter
    from the end, :data:`CUT_NOTE` between them. ``limit`` ≥ 1."""
    total = len(output)
    if total <= limit:
        return output, None
    tail = int(limit * TAIL_SHARE)
    head = limit - tail
    note = CUT_NOTE.format(cut=total - head - tail, total=total, limit=limit)
    return output[:head] + note + (output[total - tail:] if tail else ""), total
