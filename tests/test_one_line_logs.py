"""The log says each expected condition in one line (project/log_filters.py): a refused
request (403) and an SSH link that fails used to write full tracebacks — 54 of them in
one probe run of refused clicks, hundreds of paramiko lines per remote start.

Checked through the console handler Django configures from settings.LOGGING (its stream
swapped for a buffer), so the wiring is proven, not only the filters."""

from __future__ import annotations

import io
import logging
import socket
import threading
from contextlib import contextmanager

import paramiko
import pytest
from django.test import Client
from django.urls import include, path

from machines_app.models import Machine
from sessions_app.models import AgentSession


@contextmanager
def console_output():
    """What the configured console handler writes meanwhile."""
    handler = next(h for h in logging.getLogger().handlers
                   if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                   and any(type(f).__name__ == "OneLineRefusals" for f in h.filters))
    buffer = io.StringIO()
    old = handler.setStream(buffer)
    try:
        yield buffer
    finally:
        handler.setStream(old)


@pytest.mark.django_db
def test_a_refused_request_logs_one_line_not_a_traceback(alice, bob, tmp_path):
    machine = Machine.objects.create(name="m1", models_dir=str(tmp_path))
    session = AgentSession.objects.create(
        owner=alice, machine=machine, model_key="m.gguf", working_dir=str(tmp_path), status="idle",
        title="Alice's", visibility=AgentSession.Visibility.TEAM_WATCH,
    )
    client = Client()
    client.force_login(bob)
    with console_output() as out:
        response = client.post(f"/sessions/{session.pk}/send/", {"text": "let me act"})
    assert response.status_code == 403
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert f"/sessions/{session.pk}/send/" in lines[0]
    assert "Traceback" not in out.getvalue()


def test_a_failing_ssh_link_logs_paramiko_s_reason_once_without_its_traceback():
    """A real paramiko client against a port that answers with no SSH banner: paramiko's
    transport thread logs "Exception (client): Error reading SSH protocol banner" and then
    the traceback, a record per line."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def not_ssh():
        conn, _ = listener.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    threading.Thread(target=not_ssh, daemon=True).start()
    logging.getLogger("paramiko").setLevel(logging.INFO)
    with console_output() as out:
        with socket.create_connection(listener.getsockname()) as sock:
            transport = paramiko.Transport(sock)
            with pytest.raises(paramiko.SSHException):
                transport.start_client(timeout=10)
            transport.close()
    listener.close()
    text = out.getvalue()
    assert "Error reading SSH protocol banner" in text
    assert "Traceback" not in text and 'File "' not in text
    assert text.count("Error reading SSH protocol banner") == 1, text


def _fails(request):
    raise RuntimeError("a bug")


urlpatterns = [path("fails/", _fails), path("", include("project.urls"))]


@pytest.mark.django_db
def test_an_error_shows_corral_s_own_page(settings, alice):
    """With DEBUG off (the default run) an error is Corral's plain page, styled like the
    rest, never Django's bare "Server Error (500)"."""
    settings.ROOT_URLCONF = __name__
    client = Client(raise_request_exception=False)
    client.force_login(alice)
    with console_output() as out:
        response = client.get("/fails/")
    assert response.status_code == 500
    page = response.content.decode()
    assert "Something went wrong on Corral" in page and "corral.css" in page
    assert "Traceback" in out.getvalue()  # a bug keeps its traceback in the log
