"""Text a person typed, a tool returned or the model wrote never becomes a control token
(docs/security.md, "Text never becomes control tokens").

llama-server renders a request's messages with the chat template and tokenises the
result with special tokens on, so a message holding ``<|im_end|>\\n<|im_start|>system``
would close its own turn and open a system turn of its own making. Before each request
every occurrence of one of the model's special token strings (read from its GGUF
vocabulary at discovery: :attr:`machines_app.models.ModelFile.special_tokens`) in a
message's text gets a zero-width space after its first character: the text reads the
same, and the server's tokenizer no longer finds the token in it. Only the request is
changed; the transcript, the page and the exports keep the text as it was written.

Pure functions, no Django: the request's messages in, new messages out. The same
messages and strings give the same result every time, so a request's prefix stays
byte-identical and the prompt cache holds (docs/behaviour.md §7, §13).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["BREAKERS", "Neutraliser", "neutralise", "neutralise_tools"]

#: What goes after a special string's first character, the first of these that no special
#: string contains (so the break can never itself spell a token): ZERO WIDTH SPACE, WORD
#: JOINER, ZERO WIDTH NON-JOINER.
BREAKERS = ("\u200b", "\u2060", "\u200c")


class Neutraliser:
    """Breaks up the special strings ``specials`` in text.

    Strings shorter than two characters are ignored (nothing fits inside them). Matching
    looks, at each place where a special string could start (its first character), for
    the strings of each length present: a few set lookups per candidate place, however
    many strings a vocabulary has (Gemma's has thousands of ``<unused…>``).
    """

    def __init__(self, specials: Iterable[str]) -> None:
        strings = {s for s in specials if isinstance(s, str) and len(s) >= 2}
        self.strings = frozenset(strings)
        # Where a special string may start: one pass of the regex engine over the text.
        self.starts = re.compile("[" + "".join(sorted(re.escape(s[0]) for s in strings)) + "]") if strings else None
        self.lengths = sorted({len(s) for s in strings}, reverse=True)
        self.breaker = next((b for b in BREAKERS if not any(b in s for s in strings)), None)

    def text(self, text: str) -> str:
        """``text`` with a breaker after the first character of every special string in
        it (overlapping ones too), else unchanged (the same object)."""
        if self.starts is None or self.breaker is None:
            return text
        out: list[str] = []
        last = 0
        for start in self.starts.finditer(text):
            i = start.start()
            if any(text[i:i + n] in self.strings for n in self.lengths if i + n <= len(text)):
                out.append(text[last:i + 1])
                out.append(self.breaker)
                last = i + 1
        if not out:
            return text
        out.append(text[last:])
        return "".join(out)

    def content(self, content: Any) -> Any:
        """A message's ``content``: a string, or OpenAI content parts (only ``text`` parts
        are text; an ``image_url`` is left alone)."""
        if isinstance(content, str):
            return self.text(content)
        if isinstance(content, list):
            return [
                {**part, "text": self.text(part["text"])}
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                else part
                for part in content
            ]
        return content

    def message(self, message: dict[str, Any]) -> dict[str, Any]:
        """One chat message with every text in it broken up: its ``content`` (whatever
        the role: the system prompt and the model's own earlier words are text too — a
        reply that copied a tool's output must not smuggle it back as tokens) and the
        ``arguments`` and names of its tool calls. Ids and roles are left as they are."""
        changed = dict(message)
        if "content" in message:
            changed["content"] = self.content(message["content"])
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            changed["tool_calls"] = [self._call(call) for call in calls]
        return changed

    def arguments(self, raw: str) -> str:
        """A call's JSON arguments: the server parses them before the template writes
        them out again, so a token spelt with JSON escapes (``\\u003c|im_start|>``) counts
        too. When a parsed string holds a special string, the arguments are written
        anew (``json.dumps``, non-ASCII kept) from the broken-up values; otherwise, or
        when they are not JSON, the text itself is broken up."""
        try:
            parsed = json.loads(raw)
        except ValueError:
            return self.text(raw)
        cleaned = self._walk(parsed)
        return self.text(raw) if cleaned == parsed else json.dumps(cleaned, ensure_ascii=False)

    def tool(self, definition: Any) -> Any:
        """One tool definition (``{"type": "function", "function": {"name", "description",
        "parameters"}}``): every string and key in it broken up — the template writes an MCP
        server's descriptions and schema into the prompt — but ``function.name``, which a
        call must name exactly (tool names hold no token: tools.mcp_tool_name)."""
        function = definition.get("function") if isinstance(definition, dict) else None
        if not isinstance(function, dict):
            return self._walk(definition)
        cleaned = self._walk(definition)
        if "name" in function:
            cleaned["function"]["name"] = function["name"]
        return cleaned

    def _walk(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self._walk(item) for item in value]
        if isinstance(value, dict):
            return {self.text(key): self._walk(item) for key, item in value.items()}
        return value

    def _call(self, call: Any) -> Any:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return call
        changed = dict(function)
        if isinstance(function.get("arguments"), str):
            changed["arguments"] = self.arguments(function["arguments"])
        if isinstance(function.get("name"), str):
            # The model wrote it (a tool that does not exist may be called anything); a real
            # tool's name holds no token and stays as it is.
            changed["name"] = self.text(function["name"])
        return {**call, "function": changed}


def neutralise(messages: list[dict[str, Any]], specials: Iterable[str]) -> list[dict[str, Any]]:
    """``messages`` (``transcript.build_messages``'s shape) as they may be sent to a server
    whose tokenizer reads ``specials`` as special tokens: new dicts, key order kept, the
    input untouched. With no specials the messages come back as they are."""
    neutraliser = Neutraliser(specials)
    if not neutraliser.strings:
        return messages
    return [neutraliser.message(message) for message in messages]


def neutralise_tools(definitions: list[dict[str, Any]], specials: Iterable[str]) -> list[dict[str, Any]]:
    """A request's ``tools`` (OpenAI function definitions) as they may be sent to a server
    whose tokenizer reads ``specials`` as special tokens (:meth:`Neutraliser.tool`): new
    dicts, the input untouched; with no specials the list comes back as it is."""
    neutraliser = Neutraliser(specials)
    if not neutraliser.strings:
        return definitions
    return [neutraliser.tool(definition) for definition in definitions]
