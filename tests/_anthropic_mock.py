"""A scripted fake of the Anthropic HTTP API, for driving the real SDK through httpx2.MockTransport.

respx does not intercept anthropic 2.x (it uses httpx2), so tests inject
`http_client=mock.client()` into the SDK and script answers here:

    mock = AnthropicMock(lambda body: tool_answer([...]))
    forecaster = ClaudeForecaster("test-key", "claude-sonnet-4-5", http_client=mock.client())

The responder gets each /v1/messages request body (a dict) and returns a message dict (see the builders
below) or a ready httpx2.Response (errors, 429s). `mock.requests` records every request. The Message
Batches endpoints keep a little state: a created batch reports `in_progress` for `batch_polls_in_progress`
retrievals, then `ended`; its results run every batch request through the same responder.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2

Responder = Callable[[dict[str, Any]], "dict[str, Any] | httpx2.Response"]
_ids = itertools.count(1)
_API = "https://api.anthropic.com"


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or None


def user_text(body: dict[str, Any]) -> str:
    """The whole user message of a request body (the forecaster sends it in several blocks)."""
    return "\n\n".join(block["text"] for block in body["messages"][0]["content"])


def usage(
    input_tokens: int = 1000, output_tokens: int = 100, cache_read: int = 0, cache_write: int = 0
) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cache_read,
        "cache_creation_input_tokens": cache_write,
    }


def message(
    content: list[dict[str, Any]],
    *,
    stop_reason: str = "end_turn",
    model: str = "claude-sonnet-5",
    tokens: dict[str, Any] | None = None,
    stop_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": f"msg_{next(_ids):06d}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "stop_details": stop_details,
        "usage": tokens or usage(),
    }


def tool_answer(
    probs: Sequence[Any] | str,
    reasoning: str = "tiling halves DRAM traffic",
    *,
    tool_name: str = "report_speedup_forecast",
    stop_reason: str = "tool_use",
    tokens: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A forced tool call carrying `probs` (any list, even a wrong one, or a string)."""
    block = {
        "type": "tool_use",
        "id": f"toolu_{next(_ids):06d}",
        "name": tool_name,
        "input": {"reasoning": reasoning, "probabilities": probs},
    }
    return message([block], stop_reason=stop_reason, tokens=tokens)


def tool_input(payload: dict[str, Any], *, stop_reason: str = "tool_use") -> dict[str, Any]:
    """A tool call with an arbitrary input object (e.g. cut short by max_tokens)."""
    block = {"type": "tool_use", "id": f"toolu_{next(_ids):06d}", "name": "report_speedup_forecast"}
    return message([{**block, "input": payload}], stop_reason=stop_reason)


def text_answer(text: str, *, stop_reason: str = "end_turn") -> dict[str, Any]:
    """A plain text answer (JSON-schema output mode puts the JSON here)."""
    return message([{"type": "text", "text": text}], stop_reason=stop_reason)


def json_answer(probs: Sequence[float], reasoning: str = "more blocks than SMs") -> dict[str, Any]:
    return text_answer(json.dumps({"reasoning": reasoning, "probabilities": list(probs)}))


def refusal(explanation: str = "policy") -> dict[str, Any]:
    return message(
        [{"type": "text", "text": ""}],
        stop_reason="refusal",
        stop_details={"type": "refusal", "category": None, "explanation": explanation},
    )


def error(
    status: int, kind: str, text: str, headers: dict[str, str] | None = None, *, code: str | None = None
) -> httpx2.Response:
    """An API error; `code`: its error.details.error_code (the SDK raises a subclass of its own for some)."""
    body: dict[str, Any] = {"type": kind, "message": text}
    if code is not None:
        body["details"] = {"error_code": code}
    return httpx2.Response(status, headers=headers or {}, json={"type": "error", "error": body})


def rate_limited() -> httpx2.Response:
    # retry-after-ms keeps the SDK's own backoff to 1 ms (it honours the header before its exponential wait).
    return error(429, "rate_limit_error", "slow down", headers={"retry-after-ms": "1"})


@dataclass
class _Batch:
    id: str
    requests: list[dict[str, Any]]
    polls: int = 0
    canceled: bool = False


async def _breaking(chunks: list[bytes], after: int) -> Any:
    """The chunks, then a dropped connection after `after` of them (as a reset mid-download reads)."""
    for chunk in chunks[:after]:
        yield chunk
    raise httpx2.ReadError("connection reset by peer")


@dataclass
class AnthropicMock:
    """The fake API. `responder` answers /v1/messages bodies (and each batch request's params)."""

    responder: Responder
    batch_polls_in_progress: int = 1
    batch_never_ends: bool = False  # in progress until cancelled
    cancel_ends: bool = True  # a cancelled batch ends (at its next retrieval); False: it hangs
    finished_before_cancel: int = 0  # requests of a cancelled batch that had succeeded (the rest: canceled)
    batch_creates_allowed: int | None = None  # later batch creations answer 500
    batches_that_end: int | None = None  # later batches never end, cancelled or not
    results_reads_allowed: int | None = None  # later results downloads break midway (connection reset)
    broken_results_reads: frozenset[int] = frozenset()  # these results downloads (1 = the first) break midway
    failing_status_checks: int = 0  # the next this many batch status checks answer 503
    failing_status_check_headers: dict[str, str] | None = None  # ... with these headers (retry-after)
    mangle_results: Callable[[str], str] | None = (
        None  # rewrites each results file (JSON lines) as downloaded
    )
    requests: list[RecordedRequest] = field(default_factory=list)
    batches: dict[str, _Batch] = field(default_factory=dict)

    def client(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(transport=httpx2.MockTransport(self.handle))

    @property
    def message_bodies(self) -> list[dict[str, Any]]:
        """Bodies of the /v1/messages requests, in arrival order."""
        return [r.body for r in self.requests if r.method == "POST" and r.path == "/v1/messages"]

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        body: Any = json.loads(request.content) if request.content else None
        path = request.url.path
        # Drop any base-URL prefix (conftest points ANTHROPIC_BASE_URL at a path on a dead port).
        path = path[path.find("/v1/") :] if "/v1/" in path else path
        self.requests.append(RecordedRequest(request.method, path, dict(request.headers), body))
        if request.method == "POST" and path == "/v1/messages":
            return self._answer(body)
        if request.method == "POST" and path == "/v1/messages/batches":
            if self.batch_creates_allowed is not None and len(self.batches) >= self.batch_creates_allowed:
                return error(500, "api_error", "mock: batch creation failed")
            batch = _Batch(id=f"msgbatch_{next(_ids):06d}", requests=list(body["requests"]))
            self.batches[batch.id] = batch
            return httpx2.Response(200, json=self._batch_json(batch, "in_progress"))
        parts = path.strip("/").split("/")  # v1 messages batches <id> [results|cancel]
        if len(parts) >= 4 and parts[:3] == ["v1", "messages", "batches"] and parts[3] in self.batches:
            batch = self.batches[parts[3]]
            if len(parts) == 4 and request.method == "GET":
                if self.failing_status_checks > 0:
                    self.failing_status_checks -= 1
                    return error(
                        503,
                        "overloaded_error",
                        "mock: status check failed",
                        self.failing_status_check_headers,
                    )
                batch.polls += 1
                ended = (batch.canceled and self.cancel_ends) or (
                    not self.batch_never_ends and batch.polls > self.batch_polls_in_progress
                )
                if (
                    self.batches_that_end is not None
                    and list(self.batches).index(batch.id) >= self.batches_that_end
                ):
                    ended = False
                return httpx2.Response(200, json=self._batch_json(batch, "ended" if ended else "in_progress"))
            if parts[4:] == ["cancel"] and request.method == "POST":
                batch.canceled = True
                return httpx2.Response(200, json=self._batch_json(batch, "canceling"))
            if parts[4:] == ["results"] and request.method == "GET":
                return self._results(batch)
        return error(404, "not_found_error", f"mock has no route for {request.method} {path}")

    def _answer(self, body: dict[str, Any]) -> httpx2.Response:
        out = self.responder(body)
        if isinstance(out, httpx2.Response):
            return out
        return httpx2.Response(200, json={**out, "model": body["model"]})

    def _results(self, batch: _Batch) -> httpx2.Response:
        lines = []
        # Reversed: results are not in request order in the real API either.
        for n, req in reversed(list(enumerate(batch.requests))):
            out = self.responder(req["params"])
            if batch.canceled and n >= self.finished_before_cancel:
                result_: dict[str, Any] = {"type": "canceled"}
                lines.append(json.dumps({"custom_id": req["custom_id"], "result": result_}))
                continue
            if isinstance(out, httpx2.Response):
                err = json.loads(out.content)
                result: dict[str, Any] = {"type": "errored", "error": err}
            else:
                result = {"type": "succeeded", "message": {**out, "model": req["params"]["model"]}}
            lines.append(json.dumps({"custom_id": req["custom_id"], "result": result}))
        headers = {"content-type": "application/binary"}
        reads = sum(r.path.endswith("/results") for r in self.requests)
        if (self.results_reads_allowed is not None and reads > self.results_reads_allowed) or (
            reads in self.broken_results_reads
        ):
            # Cut inside the first line: no SDK version can decode a result from it (2.17 yields each complete
            # line as it arrives, so a cut after a whole line would hand that line over).
            first = f"{lines[0]}\n".encode()
            return httpx2.Response(200, content=_breaking([first[: len(first) // 2]], 1), headers=headers)
        text = "\n".join(lines) + "\n"
        if self.mangle_results is not None:
            text = self.mangle_results(text)
        return httpx2.Response(200, content=text.encode(), headers=headers)

    def _batch_json(self, batch: _Batch, status: str) -> dict[str, Any]:
        n = len(batch.requests)
        ended = status == "ended"
        # As the API: every request counts as processing until the whole batch ends; a cancelled one then counts
        # those it had finished as succeeded, the rest as canceled.
        done = min(n, self.finished_before_cancel) if batch.canceled else n
        return {
            "id": batch.id,
            "type": "message_batch",
            "processing_status": status,
            "request_counts": {
                "processing": 0 if ended else n,
                "succeeded": done if ended else 0,
                "errored": 0,
                "canceled": n - done if ended else 0,
                "expired": 0,
            },
            "created_at": "2026-10-01T00:00:00Z",
            "expires_at": "2026-10-02T00:00:00Z",
            "ended_at": "2026-10-01T00:05:00Z" if ended else None,
            "archived_at": None,
            "cancel_initiated_at": None,
            "results_url": f"{_API}/v1/messages/batches/{batch.id}/results" if ended else None,
        }
