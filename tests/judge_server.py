"""A small OpenAI-compatible chat-completions server that misbehaves on cue, for the judge's fault tests.

Only for injecting faults — the judge's real-server tests use vLLM. Each request takes the next behaviour
from `script` (then `default`): 'ok' answers {"1": s1, ...} with s_i = min(10, len(text of response i)),
read back from the "[i] text" lines of the judge's prompt; ('status', code[, body[, headers]]) answers
that HTTP status; 'malformed' answers 200 with text that is not JSON; 'not_chat' answers 200 JSON that is
no chat completion; ('slow', s) answers 'ok' after s seconds; 'hang' never answers (until close);
('trickle', s) sends the headers of an 'ok' answer, then its body one byte every s seconds. Every request
is recorded (raw body, parsed body, headers, arrival time), with the most requests in flight at once.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

USAGE = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}


def length_scores(body: dict) -> dict[str, int]:
    """The 'ok' answer: each response's score is its length in characters, at most 10."""
    user = body["messages"][-1]["content"]
    return {m.group(1): min(10, len(m.group(2))) for m in re.finditer(r"^\[(\d+)\] (.*)$", user, re.M)}


def chat_completion(content: str) -> bytes:
    return json.dumps(
        {
            "id": "judge-test",
            "object": "chat.completion",
            "model": "judge-test",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": USAGE,
        }
    ).encode()


class JudgeServer:
    def __init__(self, default="ok"):
        self.script: deque = deque()
        self.default = default
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.closing = threading.Event()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server.lock:
                    behaviour = server.script.popleft() if server.script else server.default
                    server.requests.append(
                        {
                            "raw": raw,
                            "body": json.loads(raw),
                            "headers": dict(self.headers),
                            "path": self.path,
                            "t": time.monotonic(),
                        }
                    )
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                self.in_flight = True
                try:
                    server.answer(self, behaviour, json.loads(raw))
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    server.answered(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def answer(self, handler: BaseHTTPRequestHandler, behaviour, body: dict) -> None:
        kind, *args = behaviour if isinstance(behaviour, tuple) else (behaviour,)
        if kind == "hang":
            self.closing.wait(120)
            return
        if kind == "slow":
            time.sleep(args[0])
        if kind == "status":
            code = args[0]
            text = args[1] if len(args) > 1 else "server error"
            headers = args[2] if len(args) > 2 else {}
            self._send(handler, code, json.dumps({"error": text}).encode(), headers)
        elif kind == "malformed":
            self._send(handler, 200, chat_completion("Response 1 is best, I think."))
        elif kind == "not_chat":
            self._send(handler, 200, json.dumps({"result": "ok"}).encode())
        elif kind == "trickle":
            payload = chat_completion(json.dumps(length_scores(body)))
            self.answered(handler)
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            for i in range(len(payload)):
                if self.closing.wait(args[0]):
                    return
                handler.wfile.write(payload[i : i + 1])
                handler.wfile.flush()
        else:  # ok, slow
            self._send(handler, 200, chat_completion(json.dumps(length_scores(body))))

    def answered(self, handler) -> None:
        """The request no longer counts as in flight: from the moment its answer starts (the client may send its next
        request as soon as it has read the answer, before the handler's thread returns)."""
        with self.lock:
            if handler.in_flight:
                handler.in_flight = False
                self.in_flight -= 1

    def _send(self, handler, code: int, payload: bytes, headers: dict | None = None) -> None:
        self.answered(handler)
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        for k, v in (headers or {}).items():
            handler.send_header(k, v)
        handler.end_headers()
        handler.wfile.write(payload)

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()
