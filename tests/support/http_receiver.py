"""An HTTP endpoint on 127.0.0.1 for the effects outbox's tests: it records each request's
``Idempotency-Key`` header as sent (percent-encoded or not) and its body, and answers the
next scripted reply (an int status, or ``("slow", seconds)``), else 200, after the delay
``slow`` names for the request's key."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """``url`` (path ``/hook``); ``requests``: ``(key, body)`` in arrival order (the body as
    JSON when it is, else bytes); ``script``: replies to give, first first; ``slow``: seconds
    to wait before answering a key. ``close()`` stops it."""

    def __init__(self) -> None:
        self.requests: list[tuple[str | None, Any]] = []
        self.script: list[Any] = []
        self.slow: dict[str, float] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body: Any = json.loads(raw or b"null")
                except ValueError:
                    body = raw
                key = self.headers.get("Idempotency-Key")
                with receiver.lock:
                    receiver.requests.append((key, body))
                    reply = receiver.script.pop(0) if receiver.script else 200
                time.sleep(receiver.slow.get(key or "", 0.0))
                if isinstance(reply, tuple):
                    time.sleep(reply[1])
                    reply = 200
                try:
                    self.send_response(reply)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass  # the sender gave up waiting (its timeout)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def keys(self) -> list[str | None]:
        """The keys received, in arrival order."""
        with self.lock:
            return [key for key, _body in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
