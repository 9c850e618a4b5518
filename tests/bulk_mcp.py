"""An MCP server whose one tool, ``big``, answers ``BIG_MCP_BYTES`` of numbered lines:
``python tests/bulk_mcp.py PORT`` serves it over streamable HTTP on 127.0.0.1 (blocks).
Used by tests/test_tool_bounds.py (a 30 MB result is cut before it is stored and sent)."""

from __future__ import annotations

import sys

BIG_MCP_BYTES = 30 * 1024 * 1024
LINE = "line {:07d} of a very long answer from the bulk server\n"


def big_text() -> str:
    """``BIG_MCP_BYTES`` characters of numbered lines."""
    text = "".join(LINE.format(i) for i in range(BIG_MCP_BYTES // len(LINE.format(0)) + 1))
    return text[:BIG_MCP_BYTES]


def serve(port: int) -> None:
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("bulk", log_level="WARNING")

    @server.tool()
    def big() -> str:
        """A very long answer."""
        return big_text()

    server.run("streamable-http", host="127.0.0.1", port=port)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
