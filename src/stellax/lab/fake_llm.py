"""A scripted OpenAI-compatible chat-completions server for tests and demos.

`FakeLLMServer` binds 127.0.0.1 only (an ephemeral port), answers ``POST
.../chat/completions`` with the scripted replies in order (then HTTP 503),
rejects request bodies over 1 MiB, and stops by itself after
``max_requests`` requests or ``lifetime`` seconds, whichever comes first.
A reply is a string (the message content) or a dict ``{"content": str,
"delay": seconds}`` (to test time-outs) or ``{"status": code}`` (an HTTP
error). Every request body is kept in ``received``.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Sequence

MAX_BODY = 1 << 20


class FakeLLMServer:
    def __init__(self, replies: Sequence, *, max_requests: int = 64, lifetime: float = 900.0):
        self.replies = list(replies)
        self.max_requests = max_requests
        self.lifetime = lifetime
        self.requests = 0
        self.received: list[dict] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    self.send_error(413, "request body too large")
                    return
                body = self.rfile.read(length)
                with server._lock:
                    server.requests += 1
                    index = server.requests - 1
                    try:
                        server.received.append(json.loads(body))
                    except ValueError:
                        server.received.append({"raw": body[:200].decode("utf-8", "replace")})
                    if server.requests >= server.max_requests:
                        threading.Thread(target=server.stop, daemon=True).start()
                if not self.path.endswith("/chat/completions"):
                    self.send_error(404, "only /chat/completions is served")
                    return
                if index >= len(server.replies):
                    self.send_error(503, "the script has no more replies")
                    return
                reply = server.replies[index]
                if isinstance(reply, dict) and reply.get("status"):
                    self.send_error(int(reply["status"]), "scripted error")
                    return
                if isinstance(reply, dict):
                    time.sleep(float(reply.get("delay", 0)))
                    reply = reply.get("content", "")
                data = json.dumps({"id": f"fake-{index}", "object": "chat.completion", "model": "scripted",
                                   "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": reply}}]}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._timer = threading.Timer(lifetime, self.stop)
        self._timer.daemon = True
        self._stopped = False

    def start(self) -> "FakeLLMServer":
        self._thread.start()
        self._timer.start()
        return self

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "FakeLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _fence(code: str) -> str:
    return f"Here is a candidate.\n\n```python\n{code.strip()}\n```\n"


_HEADER = '''import dataclasses

import jax
import stellax
from jax import lax

OP = {op!r}
_BASE = stellax.registered_ops()[OP].implementations["xla"]
'''


def demo_replies(op: str = "gated_linear_unit", operand: str = "x") -> list[str]:
    """Scripted replies for ``op``: a malformed one (no code), then a candidate
    that does not import, one numerically wrong, one correct but slow (the
    built-in path computed five times in a loop the compiler cannot hoist) and
    one correct and faster than that (the built-in path once)."""
    head = _HEADER.format(op=op)
    broken = head + "import stellax_module_that_does_not_exist\n\nIMPLEMENTATION = dataclasses.replace(_BASE, name='broken')\n"
    wrong = head + '''

def run(call, config):
    out = _BASE.run(call, config)
    return jax.tree_util.tree_map(lambda y: y * 1.01, out)


IMPLEMENTATION = dataclasses.replace(_BASE, name="wrong", run=run)
'''
    slow = head + f'''

def run(call, config):
    first = _BASE.run(call, config)

    def again(i, previous):
        # Depends on the carry, so XLA cannot hoist it out of the loop; adds exactly 0.
        nudged = call.{operand} + (previous.reshape(-1)[0] * 0.0).astype(call.{operand}.dtype)
        return _BASE.run(call.replace_arrays({operand}=nudged), config)
    return lax.fori_loop(0, 4, again, first)


IMPLEMENTATION = dataclasses.replace(_BASE, name="slow", run=run)
'''
    fast = head + '''

def run(call, config):
    return _BASE.run(call, config)


IMPLEMENTATION = dataclasses.replace(_BASE, name="fast", run=run)
'''
    return ["I would try a fused kernel with larger tiles.", _fence(broken), _fence(wrong), _fence(slow),
            _fence(fast)]
