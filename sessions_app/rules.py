"""Text rules that pages, forms and the write layer share, with no import of their own:
a module below everything that reads them (docs/architecture.md, the layers)."""

#: The longest message a person may send, in characters (after surrounding spaces are cut).
MAX_MESSAGE_CHARS = 200_000
