"""An idempotent HTTP receiver on loopback for the effects outbox's checks (``checker``,
``tests/faults/test_outbox_faults.py``, ``benchmarks/outbox.py``).

:class:`Receiver` is a real HTTP server (``http.server.ThreadingHTTPServer`` on 127.0.0.1, in a
thread of the controller's process) that answers ``POST <any path>``:

- every request is a *receipt*, counted per ``Idempotency-Key`` header value;
- the first receipt of a key *applies* it (the receiver's business effect: the request's JSON
  body is kept as the application's record); a later receipt of the same key is answered 200
  with the first outcome and applies nothing (as a payment provider's idempotency key does);
- a request without the header is applied every time (a receiver that cannot dedupe).

:meth:`Receiver.stop` closes the port (a receiver down: connections refused) and
:meth:`Receiver.start` opens the same port again. ``fail_next(n, status)`` answers the next
``n`` requests with ``status`` (a 5xx the relay must retry, a 4xx it must not) without
receiving them. Times are ``time.time()`` seconds; :attr:`first_seen` maps key -> the wall
time of its first receipt (the dispatch latency's end).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Receipt:
    """What the receiver saw of one key: ``count`` receipts, ``applied`` applications (1 for
    an idempotent receiver, whatever ``count`` is), ``body`` the first request's JSON body (a
    dict; ``{}`` when it was not JSON), ``first_seen`` wall seconds."""

    key: str
    count: int = 0
    applied: int = 0
    body: dict = field(default_factory=dict)
    first_seen: float = 0.0


class Receiver:
    """See the module docstring. ``port`` 0 picks a free port on :meth:`start` (kept for the
    restarts)."""

    def __init__(self, port: int = 0):
        self.port = port
        self.receipts: dict[str, Receipt] = {}
        self.anonymous: list[dict] = []  # bodies of requests without a key (applied each time)
        self.refused = 0  # requests answered by fail_next
        self._fail: list[int] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- server ------------------------------------------------------------------------------

    def start(self) -> Receiver:
        if self._server is not None:
            return self
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                status = receiver._receive(self.headers.get("Idempotency-Key"), raw)
                payload = b'{"ok": true}' if status < 300 else b'{"ok": false}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_PUT = do_POST  # noqa: N815

            def log_message(self, *args):  # quiet: the counts are the record
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the port: later connections are refused until :meth:`start`."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    @property
    def up(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/effects"

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- behaviour ---------------------------------------------------------------------------

    def fail_next(self, n: int, status: int = 503) -> None:
        """Answer the next ``n`` requests with ``status`` and record nothing of them."""
        with self._lock:
            self._fail.extend([status] * n)

    def reset(self) -> None:
        with self._lock:
            self.receipts.clear()
            self.anonymous.clear()
            self.refused = 0
            self._fail.clear()

    def _receive(self, key: str | None, raw: bytes) -> int:
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {"value": body}
        with self._lock:
            if self._fail:
                self.refused += 1
                return self._fail.pop(0)
            if not key:
                self.anonymous.append(body)
                return 200
            receipt = self.receipts.get(key)
            if receipt is None:
                receipt = self.receipts[key] = Receipt(
                    key=key, applied=1, body=body, first_seen=time.time()
                )
            receipt.count += 1
            return 200

    # -- what it saw -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Receipt]:
        """A copy of the receipts, key -> :class:`Receipt`."""
        with self._lock:
            return {
                k: Receipt(r.key, r.count, r.applied, dict(r.body), r.first_seen)
                for k, r in self.receipts.items()
            }

    def counts(self) -> dict:
        """``{"keys", "receipts", "applied", "redelivered", "anonymous", "refused"}``:
        distinct keys, requests received, applications, keys received more than once."""
        with self._lock:
            return {
                "keys": len(self.receipts),
                "receipts": sum(r.count for r in self.receipts.values()),
                "applied": sum(r.applied for r in self.receipts.values()) + len(self.anonymous),
                "redelivered": sum(1 for r in self.receipts.values() if r.count > 1),
                "anonymous": len(self.anonymous),
                "refused": self.refused,
            }


__all__ = ["Receipt", "Receiver"]
