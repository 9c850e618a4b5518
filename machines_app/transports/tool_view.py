"""A machine as a tool call sees it (:class:`ToolView`)."""

from __future__ import annotations

from .base import CommandResult, FileInfo, Transport


class ToolView:
    """A machine as a tool call sees it: what Corral does there *for a tool* (the built-ins
    it runs itself, sessions_app.tools.machine; the file a write's card compares with,
    sessions_app.callcard) reaches no more than a tool in that machine's sandbox would
    (docs/security.md "What a tool can reach").

    Commands run in the sandbox when ``bwrap`` is bubblewrap's path there ('' where the
    machine has none: the same exposure as its server's tools). A path inside what the
    sandbox hides (Corral's data directory here, ``~/.corral`` there), or a masked secret
    file (its own, or one of ``mask``), reads as nothing there: no file, no directory, no bytes. Everything else is the
    wrapped transport's. Raises what the transport raises."""

    def __init__(self, transport: Transport, bwrap: str, mask: tuple[str, ...] = ()) -> None:
        self.transport, self.bwrap, self.mask = transport, bwrap, mask
        self._reach: dict[str, bool] = {}

    def __getattr__(self, name: str):
        return getattr(self.transport, name)

    def reachable(self, path: str) -> bool:
        if path not in self._reach:
            self._reach[path] = self.transport.reachable_by_tools(path, self.mask)
        return self._reach[path]

    def run_command(self, argv: list[str], **kwargs) -> CommandResult:
        return self.transport.run_command(argv, bwrap=self.bwrap, mask=self.mask, **kwargs)

    def file_info(self, path: str) -> FileInfo | None:
        return self.transport.file_info(path) if self.reachable(path) else None

    def read_head(self, path: str, nbytes: int, offset: int = 0) -> bytes:
        return self.transport.read_head(path, nbytes, offset) if self.reachable(path) else b""

    def is_file(self, path: str) -> bool:
        return self.reachable(path) and self.transport.is_file(path)

    def is_dir(self, path: str) -> bool:
        return self.reachable(path) and self.transport.is_dir(path)
