"""A threaded HTTP server that speaks JSON: the plumbing the engine stand-ins share
(``harness.sglang_keyed``, ``tests/sglang_standin.py``). Each supplies one function,
``answer(method, path, body) -> (status, payload)``; a body that is not JSON is refused with 400
before it is called, and a ``str`` payload goes out as text."""

from __future__ import annotations

import json
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[str, str, Any], tuple[int, Any]]


class JsonHandler(BaseHTTPRequestHandler):
    """HTTP/1.0: the connection closes after each answer."""

    server: JsonServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self.send_json(400, {"error": {"message": "body is not JSON"}})
        status, payload = self.server.answer(method, self.path.split("?")[0], body)
        self.send_json(status, payload)

    def send_json(self, status: int, payload: Any) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class KeepAliveJsonHandler(JsonHandler):
    """HTTP/1.1: the connection stays open after an answer, as uvicorn's does (SGLang, vLLM)."""

    protocol_version = "HTTP/1.1"


class JsonServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], answer: Answer, keep_alive: bool = False) -> None:
        super().__init__(addr, KeepAliveJsonHandler if keep_alive else JsonHandler)
        self.answer = answer
