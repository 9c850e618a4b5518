"""A Web Push service standing in for the browser vendors' (FCM, Mozilla's autopush), which a
test cannot reach: it takes what ``pywebpush`` really sends (RFC 8030 ``POST`` to the
subscription's endpoint, the body encrypted as RFC 8291 says, signed with VAPID, RFC 8292)
and keeps each request; :meth:`PushService.read` decrypts one with the subscription's own
private key and auth secret (``http_ece``, as a browser would) and checks its VAPID
signature (``cryptography``). It answers 201 Created, or the statuses queued in
``answers`` or ``answer_for`` (410 Gone: the subscription expired).

:class:`Device` is a subscribing browser's half: a P-256 key pair and a 16-byte auth
secret, and the subscription JSON ``PushSubscription.toJSON()`` would give.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import http_ece
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass
class Device:
    """A browser's side of one push subscription."""

    endpoint: str
    key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    auth: bytes = field(default_factory=lambda: os.urandom(16))

    @property
    def p256dh(self) -> str:
        return b64url(self.key.public_key().public_bytes(serialization.Encoding.X962,
                                                         serialization.PublicFormat.UncompressedPoint))

    def subscription(self) -> dict:
        return {"endpoint": self.endpoint, "expirationTime": None, "keys": {"p256dh": self.p256dh,
                                                                            "auth": b64url(self.auth)}}


@dataclass
class Received:
    path: str
    headers: dict
    body: bytes


class PushService:
    """The stand-in, listening on 127.0.0.1 in a thread until :meth:`close`."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.answers: list[int] = []  # statuses for the next requests, in order; then 201
        self.answer_for: dict[str, int] = {}  # a device's endpoint path → the status it always gets
        self.lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with service.lock:
                    service.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    status = service.answer_for.get(self.path) or (service.answers.pop(0) if service.answers else 201)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def device(self, name: str) -> Device:
        return Device(f"{self.origin}/push/{name}")

    def wait(self, count: int, timeout: float = 60.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.received) >= count:
                    return list(self.received)
            time.sleep(0.1)
        raise AssertionError(f"the push service received {len(self.received)} requests, not {count}")

    def read(self, request: Received, device: Device, vapid_public_key: str) -> dict:
        """The message in ``request``, decrypted as the subscribed browser would; raises
        AssertionError when it is not what RFC 8030/8291/8292 ask for: the aes128gcm
        encoding, a TTL, a VAPID JWT (ES256) signed by ``vapid_public_key`` for this push
        service's origin, not expired."""
        assert request.path == device.endpoint.removeprefix(self.origin)
        assert request.headers["content-encoding"] == "aes128gcm"
        assert int(request.headers["ttl"]) > 0
        scheme, _, params = request.headers["authorization"].partition(" ")
        assert scheme == "vapid"
        fields = dict(part.strip().split("=", 1) for part in params.split(","))
        assert fields["k"] == vapid_public_key
        header, claims, signature = fields["t"].split(".")
        assert json.loads(unb64url(header)) == {"typ": "JWT", "alg": "ES256"}
        raw = unb64url(signature)
        public = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), unb64url(vapid_public_key))
        der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
        public.verify(der, f"{header}.{claims}".encode(), ec.ECDSA(hashes.SHA256()))  # raises when forged
        said = json.loads(unb64url(claims))
        assert said["aud"] == self.origin and said["exp"] > time.time() and said["sub"]
        plain = http_ece.decrypt(request.body, private_key=device.key, auth_secret=device.auth, version="aes128gcm")
        return json.loads(plain)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
