"""Processes and ports the test modules share: free ports, waiting, stopping a child, and
the MCP servers that tests/test_tools.py and tests/test_allowances.py serve when run as
scripts (``--serve-mcp``).

Standard library only, no Django and no relative imports: tests/test_tools.py imports it
at its top and also runs as a script, where neither is set up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


#: The header the MCP server of tests/test_tools.py asks for.
API_KEY_HEADER = {"Authorization": "Bearer test-key-123"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, wait 5 s, SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def start_mcp_server(log_dir: Path) -> tuple[subprocess.Popen, int]:
    """tests/test_tools.py's MCP server (``--serve-mcp PORT``) on a free port, once it listens."""
    port = free_port()
    log = open(log_dir / f"mcp-{port}.log", "wb")  # noqa: SIM115 - the child keeps writing to it
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "test_tools.py"), "--serve-mcp", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"MCP server exited: {(log_dir / f'mcp-{port}.log').read_text()[-2000:]}")
        return port_open(port)

    wait_until(up, 30, "the MCP server to listen")
    return proc, port


def start_described_mcp(tmp_path, description: str, port: int | None = None) -> tuple[subprocess.Popen, int]:
    """tests/test_allowances.py's MCP server (``--serve-mcp PORT DESCRIPTION``) on ``port``
    (a free one when None), once it listens."""
    port = port or free_port()
    log = open(tmp_path / f"mcp-{port}-{len(description)}.log", "wb")  # noqa: SIM115 - the child writes to it
    proc = subprocess.Popen([sys.executable, str(HERE / "test_allowances.py"), "--serve-mcp", str(port), description],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_until(lambda: port_open(port), 30, "the MCP server to listen")
    return proc, port
