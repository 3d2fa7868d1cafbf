"""The ``llm`` proposer: any OpenAI-compatible chat-completions endpoint.

The prompt carries the op's docstring and reference (golden) source, the
candidate format, the current best candidate's source and its last report
summary. Code is taken from the reply's last fenced Python block that
defines ``IMPLEMENTATION`` or ``BASE`` (or the whole reply when it is bare
code). A malformed reply (no such code, or a response that is not a chat
completion) is recorded in the archive's ``attempts`` and retried; an
endpoint that refuses the connection, times out or keeps failing raises a
`LabError` naming the URL and the problem.

Base URL, model and key come from arguments, else ``STELLAX_LAB_BASE_URL`` /
``STELLAX_LAB_MODEL`` / ``STELLAX_LAB_API_KEY``, else ``OPENAI_BASE_URL`` /
``OPENAI_MODEL`` / ``OPENAI_API_KEY``.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import socket
import urllib.error
import urllib.request

from .candidate import __doc__ as CANDIDATE_FORMAT
from .errors import LabError
from .mutate import Proposal

FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.S)
DEFINES = re.compile(r"^(IMPLEMENTATION|BASE)\s*=", re.M)
MAX_REPLY_BYTES = 2_000_000


def extract_code(reply: str) -> str | None:
    """The candidate source in an LLM reply, or ``None`` when there is none."""
    blocks = [b for b in FENCE.findall(reply) if DEFINES.search(b)]
    if blocks:
        return blocks[-1].strip() + "\n"
    if "```" not in reply and DEFINES.search(reply):
        return reply.strip() + "\n"
    return None


def op_context(op) -> str:
    """The op's docstring and reference source for the prompt."""
    import stellax
    fn = getattr(stellax, op.name, None)
    doc = inspect.getdoc(fn) if fn is not None else None
    try:
        ref = inspect.getsource(inspect.unwrap(op.reference_fn))  # past bad-data wrappers: the math
    except (OSError, TypeError):
        ref = "(source unavailable)"
    impls = ", ".join(f"{n} ({i.backend}{', ' + i.config_type.__name__ if i.config_type else ''})"
                      for n, i in op.implementations.items())
    return (f"Op `{op.name}` (family {op.family}); implementations: {impls}.\n\n"
            f"Docstring:\n{doc or '(none)'}\n\nReference implementation (the golden, float32):\n```python\n{ref}```\n")


def build_messages(context) -> list[dict]:
    best = context.best
    report = (best.get("report") or {}).get("summary", "") if best else ""
    system = ("You write faster implementations of stellax ops (JAX / Pallas). Reply with exactly one "
              "```python fenced block holding a complete candidate file; nothing else is executed.")
    user = (f"{op_context(context.op)}\nCandidate file format:\n{CANDIDATE_FORMAT}\n"
            f"The current best candidate (#{best['id']}):\n```python\n{best['source']}```\n\n"
            f"Its last evaluation report:\n{report}\n\n"
            "Write a candidate that is correct on every tier and faster than the current best.")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


class LLMProposer:
    """Proposes candidates by asking a chat-completions endpoint."""

    name = "llm"
    #: Replies that repeat a candidate the run has seen, per step, before the search stops.
    max_duplicates = 2

    def __init__(self, *, base_url: str, model: str, api_key: str | None = None, timeout: float = 120.0,
                 retries: int = 3, temperature: float = 0.7):
        if not base_url:
            raise LabError("llm proposer: no base URL (pass --base-url or set STELLAX_LAB_BASE_URL / OPENAI_BASE_URL)")
        if not model:
            raise LabError("llm proposer: no model (pass --model or set STELLAX_LAB_MODEL / OPENAI_MODEL)")
        if retries < 1:
            raise LabError(f"--llm-retries: expected at least 1, got {retries}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key = model, api_key
        self.timeout, self.retries, self.temperature = float(timeout), int(retries), float(temperature)

    @classmethod
    def from_environment(cls, *, base_url=None, model=None, api_key=None, **kwargs) -> "LLMProposer":
        env = os.environ.get
        return cls(base_url=base_url or env("STELLAX_LAB_BASE_URL") or env("OPENAI_BASE_URL") or "",
                   model=model or env("STELLAX_LAB_MODEL") or env("OPENAI_MODEL") or "",
                   api_key=api_key or env("STELLAX_LAB_API_KEY") or env("OPENAI_API_KEY"), **kwargs)

    def complete(self, messages: list[dict]) -> str:
        """One chat completion; the reply text. `LabError` for a refused or timed-out request;
        ``ValueError`` for an HTTP error or a response that is not a chat completion."""
        body = json.dumps({"model": self.model, "messages": messages, "temperature": self.temperature}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read(MAX_REPLY_BYTES + 1)
        except urllib.error.HTTPError as e:
            raise ValueError(f"HTTP {e.code} from {self.url}: {e.read(2000).decode('utf-8', 'replace')}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise LabError(f"LLM endpoint {self.url}: no answer within {self.timeout:g} s") from None
            raise LabError(f"LLM endpoint {self.url}: {e.reason} (is the server running?)") from None
        except (socket.timeout, TimeoutError):
            raise LabError(f"LLM endpoint {self.url}: no answer within {self.timeout:g} s") from None
        if len(raw) > MAX_REPLY_BYTES:
            raise ValueError(f"reply larger than {MAX_REPLY_BYTES} bytes")
        try:
            return json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(f"not a chat completion: {raw[:300]!r}") from None

    def propose(self, context) -> Proposal:
        messages = build_messages(context)
        problems = []
        for attempt in range(1, self.retries + 1):
            try:
                reply = self.complete(messages)
            except ValueError as e:
                if isinstance(e, LabError):
                    raise
                problems.append(str(e))
                context.archive.add_attempt(context.run_id, "bad_response", str(e))
                continue
            code = extract_code(reply)
            if code is None:
                problems.append("no ```python block defining IMPLEMENTATION or BASE")
                context.archive.add_attempt(context.run_id, "malformed", reply)
                messages = messages + [{"role": "assistant", "content": reply},
                                       {"role": "user", "content": "Your reply had no ```python block defining "
                                                                   "IMPLEMENTATION or BASE. Reply with the complete "
                                                                   "candidate file in one fenced block."}]
                continue
            return Proposal(code, context.best["id"], f"llm reply (attempt {attempt})")
        raise LabError(f"LLM endpoint {self.url}: {self.retries} attempts gave no usable candidate: "
                       + "; ".join(problems)[:1000])
