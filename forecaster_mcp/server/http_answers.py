"""The HTTP server's refusals, reworded to say what the client should send instead.

The MCP SDK answers a developer's first mistakes with bare words: "Authentication required" whether the
request had no token or a refused one, "Not Found" for a path other than /mcp, "Invalid Content-Type header",
"Missing session ID", "Request body too large". `Reworded` wraps the SDK's app and replaces only those exact
answers (status and body as the SDK writes them), after the SDK decided them: which requests are refused, and
with which status and OAuth error code, stays the SDK's decision. A 401 is worded from the request's own
`Authorization` header alone (nothing is looked up), so it says nothing about which tokens or ledgers exist.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

MCP_PATH = "/mcp"

# What the SDK (mcp 2.x) answers, byte for byte; anything else passes through untouched.
_SDK_CHALLENGE = b'Bearer error="invalid_token", error_description="Authentication required"'
_SDK_NOT_FOUND = b"Not Found"
_SDK_BAD_CONTENT_TYPE = b"Invalid Content-Type header"
_SDK_TOO_LARGE = b"Request body too large"
_SDK_NO_SESSION = "Bad Request: Missing session ID"

_SEND_TOKEN = "send Authorization: Bearer <token> with every request"
_ISSUE = "an operator issues a token with `forecaster-mcp token issue --ledger NAME` (printed once)"


def unauthenticated(authorization: str | None) -> str:
    """Why a request with this `Authorization` header (None: none) was refused, and what to send instead.

    The SDK takes a header that starts with `Bearer ` (any case) and checks what follows it; every other header
    counts as no token. Only the header is read here: a refused token is "not known or revoked", the same
    words for every token, so a refusal tells nothing about which tokens were ever issued."""
    if authorization is None:
        return f"no bearer token: {_SEND_TOKEN}; {_ISSUE}"
    value = authorization.strip()
    if value.lower() == "bearer":  # what `Bearer ${FORECASTER_MCP_TOKEN}` becomes with the variable unset
        return (
            "no token after `Bearer` in the Authorization header (an environment variable such as "
            f"FORECASTER_MCP_TOKEN that is not set?): {_SEND_TOKEN}; {_ISSUE}"
        )
    if not authorization.lower().startswith("bearer "):
        if not value or any(ch.isspace() for ch in value):
            return (
                f"the Authorization header is not a bearer token: {_SEND_TOKEN} (a static token: there is no "
                f"OAuth or password login); {_ISSUE}"
            )
        return f"the Authorization header holds a token without `Bearer `: {_SEND_TOKEN}"
    token = authorization[len("bearer ") :]
    hint = ""
    if token != token.strip() or token.strip()[:1] in ("'", '"') or token.strip()[-1:] in ("'", '"'):
        hint = " The token sent has quotes or spaces around it: send it exactly as printed."
    elif not token.startswith("fmcp_"):
        hint = " Tokens this server issues start with fmcp_."
    return (
        "this bearer token is not known to this server or was revoked: ask the server's operator for a token "
        "(`forecaster-mcp token issue --ledger NAME`; `forecaster-mcp token list` shows which are revoked). A "
        "token issued with another state folder than the server's (FORECASTER_MCP_HOME) is not known to it."
        + hint
    )


def _header(scope: Message, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _with_body(start: Message, body: bytes, **replaced: bytes) -> Message:
    """`start` with its content-length set for `body` and the named headers (underscores for dashes) replaced."""
    replace = {name.replace("_", "-").encode(): value for name, value in replaced.items()}
    replace[b"content-length"] = str(len(body)).encode()
    headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() not in replace]
    return {**start, "headers": [*headers, *replace.items()]}


class Reworded:
    """ASGI wrapper over the SDK's streamable-HTTP app: its bare refusals (module docstring) say what to send.

    Also serves /mcp/ as /mcp, and drops the `mcp-session-id` header from a refused request that carried none: the SDK opened a session
    for it and discarded it again at once, so the id it names only answers "Session not found"."""

    def __init__(self, app: Any, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Message, receive: Any, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("path") == MCP_PATH + "/":
            # Served as /mcp. Starlette's own answer is a 307 to http://<Host>/mcp, which behind a TLS proxy that
            # keeps the Host header sends the client to plain http.
            scope = {**scope, "path": MCP_PATH, "raw_path": MCP_PATH.encode()}
        held: Message | None = None
        chunks: list[bytes] = []

        async def send_reworded(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400:
                if _header(scope, b"mcp-session-id") is None:
                    message = {
                        **message,
                        "headers": [
                            (k, v) for k, v in message.get("headers") or [] if k.lower() != b"mcp-session-id"
                        ],
                    }
                if message["status"] in (400, 401, 404, 413):
                    held = message  # a refusal's body is small and sent whole: hold it to reword it
                    return
            elif held is not None and message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))
                if message.get("more_body", False):
                    return
                start, body = self._reword(scope, held, b"".join(chunks))
                held = None
                await send(start)
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, send_reworded)

    def _reword(self, scope: Message, start: Message, body: bytes) -> tuple[Message, bytes]:
        status = start["status"]
        headers = {bytes(k).lower(): bytes(v) for k, v in start.get("headers") or []}
        if status == 401 and headers.get(b"www-authenticate") == _SDK_CHALLENGE:
            # The SDK's challenge and OAuth error code, with a description that says which case it is. Written
            # for a quoted-string: plain ASCII, no quote or backslash.
            why = unauthenticated(_header(scope, b"authorization"))
            reworded = json.dumps({"error": "invalid_token", "error_description": why}).encode()
            challenge = f'Bearer error="invalid_token", error_description="{why}"'.encode()
            return _with_body(start, reworded, www_authenticate=challenge), reworded
        text = b""
        if status == 404 and body == _SDK_NOT_FOUND and scope.get("path") != MCP_PATH:
            text = (
                b"Not Found: this forecaster-mcp server serves MCP at /mcp only (streamable HTTP): point the "
                b"client at http://HOST:PORT/mcp, with Authorization: Bearer <token>"
            )
        elif status == 400 and body == _SDK_BAD_CONTENT_TYPE:
            text = (
                b"Invalid Content-Type header: POST each JSON-RPC message with Content-Type: application/json "
                b"(and Accept: application/json, text/event-stream)"
            )
        elif status == 413 and body == _SDK_TOO_LARGE:
            text = f"Request body too large: this server takes at most {self.max_body_bytes // 2**20} MiB".encode()
        elif status == 400:
            text = self._reworded_session_error(body)
        body = text or body
        return _with_body(start, body), body

    @staticmethod
    def _reworded_session_error(body: bytes) -> bytes:
        try:
            answer = json.loads(body)
            if answer["error"]["message"] != _SDK_NO_SESSION:
                return body
        except (ValueError, KeyError, TypeError):
            return body
        answer["error"]["message"] = (
            f"{_SDK_NO_SESSION}: open a session with an initialize request first, then send the mcp-session-id "
            "header its response carries with every later request (an MCP client library does this for you)"
        )
        return json.dumps(answer, separators=(",", ":")).encode()
