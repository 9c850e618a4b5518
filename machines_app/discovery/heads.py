"""Reading a model file's head: header and metadata only, never the weights
(docs/behaviour.md C42). One file at a time (:func:`read_model_head`) or many in batches
(:func:`read_model_heads`), reading on from where the last read stopped until the metadata
parses (:mod:`machines_app.gguf`)."""

from __future__ import annotations

from collections.abc import Callable

from ..gguf import GGUFError, GGUFHead, NeedMoreBytes, parse_head

#: First read of every file: enough for the metadata of nearly all models.
INITIAL_HEAD_BYTES = 2 * 1024 * 1024
#: Largest head ever read; metadata beyond this is reported as an error.
MAX_HEAD_BYTES = 64 * 1024 * 1024

#: ``read_head(key, nbytes, offset=0)``: up to ``nbytes`` of that file from byte
#: ``offset`` (fewer only where the file ends). The first read of a file is from its start
#: and passes no offset.
ReadHead = Callable[..., bytes]

#: ``read_ranges([(key, offset, nbytes), ...])``: for each, what ``read_head`` would give, or
#: the OSError that file gave; one call may serve many files at once (a pipelined batch
#: over SFTP, see ``Transport.read_ranges``).
ReadRanges = Callable[[list[tuple[str, int, int]]], list]

#: Bytes one batch of :func:`read_model_heads` asks for at most (all of it is held in memory).
BATCH_BYTES = 64 * 1024 * 1024


def _next_ask(data: bytes, asked: int, exc: NeedMoreBytes) -> int:
    """How many bytes from the start to hold next, after a parse of ``data`` (``asked``
    were asked for) raised ``exc``; raises GGUFError when there is no point reading on."""
    if len(data) < asked:
        if len(data) < 8:
            raise GGUFError(f"not a GGUF file (only {len(data)} bytes long)") from None
        raise GGUFError("the file ends inside its GGUF metadata (truncated or still being copied?)") from None
    if asked >= MAX_HEAD_BYTES or exc.needed > MAX_HEAD_BYTES:
        raise GGUFError(f"metadata larger than {MAX_HEAD_BYTES // (1024 * 1024)} MiB") from None
    margin = min(exc.needed // 8, INITIAL_HEAD_BYTES)
    return min(max(exc.needed + margin, asked + asked // 4), MAX_HEAD_BYTES)


def read_model_heads(keys: list[str], read_ranges: ReadRanges) -> dict[str, GGUFHead | GGUFError | OSError]:
    """The heads of many files, read in rounds: every file's first INITIAL_HEAD_BYTES in
    one batch, then for those whose metadata goes on, only the bytes past those held, sized
    as :func:`read_model_head` sizes them (what the header says it needs, plus a margin),
    all of them in the next batch. A batch holds at most BATCH_BYTES (files past that wait
    for the next), so a directory of any size is read in bounded memory and, over SSH, in
    a few round trips per batch rather than one per request.

    Returns each key's GGUFHead, or the GGUFError / OSError that file gave."""
    done: dict[str, GGUFHead | GGUFError | OSError] = {}
    state = {key: (b"", INITIAL_HEAD_BYTES) for key in keys}  # bytes held, bytes to hold
    while state:
        batch: list[tuple[str, int, int]] = []
        total = 0
        for key, (data, asked) in state.items():
            want = asked - len(data)
            if batch and total + want > BATCH_BYTES:
                break
            batch.append((key, len(data), want))
            total += want
        answers = read_ranges(batch)
        for (key, _offset, _want), answer in zip(batch, answers, strict=True):
            data, asked = state.pop(key)
            if isinstance(answer, OSError):
                done[key] = answer
                continue
            data += bytes(answer)
            try:
                done[key] = parse_head(data)
            except NeedMoreBytes as exc:
                try:
                    state[key] = (data, _next_ask(data, asked, exc))
                except GGUFError as error:
                    done[key] = error
            except GGUFError as exc:
                done[key] = exc
    return done


def ranges_from(read_head: ReadHead) -> ReadRanges:
    """A :data:`ReadRanges` that reads one range after the other through ``read_head``."""

    def read_ranges(ranges: list[tuple[str, int, int]]) -> list:
        answers: list = []
        for key, offset, nbytes in ranges:
            try:
                answers.append(read_head(key, nbytes) if offset == 0 else read_head(key, nbytes, offset=offset))
            except OSError as exc:
                answers.append(exc)
        return answers

    return read_ranges


def read_model_head(key: str, read_head: ReadHead) -> GGUFHead:
    """Read and parse the head of one file, reading on from where the last read stopped
    until the metadata fits (docs/behaviour.md C42: a header, not the file).

    The first read is INITIAL_HEAD_BYTES from the start; on NeedMoreBytes only the bytes
    past those already held are asked for (``read_head(key, nbytes, offset=have)``), up to
    ``needed`` plus a margin of an eighth of it (at most INITIAL_HEAD_BYTES) for the small
    keys after a long value, and at least a quarter more than before. ``needed`` never
    exceeds what the metadata takes (it is exact for strings, a lower bound for long
    arrays), so a file costs its metadata plus at most INITIAL_HEAD_BYTES, and never
    more than MAX_HEAD_BYTES in all, whatever its header claims.

    Raises GGUFError (plain-words message) for a non-GGUF or corrupt file, a file that
    ends inside its metadata, or metadata larger than MAX_HEAD_BYTES. Exceptions from
    read_head propagate.
    """
    data = bytes(read_head(key, INITIAL_HEAD_BYTES))
    asked = INITIAL_HEAD_BYTES
    while True:
        try:
            return parse_head(data)
        except NeedMoreBytes as exc:
            asked = _next_ask(data, asked, exc)
            # A new bytes object (a copy: a few per file at most): the parse's views of the
            # old one may live on in the exception's frames.
            data += read_head(key, asked - len(data), offset=len(data))
