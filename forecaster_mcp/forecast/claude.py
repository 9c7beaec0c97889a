"""Claude as a forecaster: the paper's LLM surrogate with structured output, sampling, caching and batches.

Only this module imports anthropic, and only when a ClaudeForecaster is built (the SDK takes over a second
to import, which the server's start-up path must not pay when no key is configured).

How one pair is forecast:
- the prompt is a fixed system prompt (instructions, the 8 bins from `forecaster_mcp.bins`, output rules)
  marked for prompt caching, then a per-pair user message in two blocks: the part every pair against the same
  baseline shares (GPU, workload, the baseline's source and static features), marked for caching too when another
  request will read it (`_marked`), so the other candidates of a compare (and later compares against that
  baseline) read it from the cache; then the candidate's part (its kernel, what differs, its static features);
- the answer is forced structured output: a forced tool call, or on models that refuse forced tool use
  (Opus 5.5, Sonnet 5.5, ...) a JSON-schema output format;
- `samples` separate requests are sampled, validated, averaged, and shrunk toward uniform by how much
  their p_faster disagree (their spread is a signal of uncertainty the mean alone hides);
- the SDK retries rate limits and server errors itself; tenacity retries only unusable answers;
- each answered sample is kept (by the hash of its prompt) as it arrives: asked again, a pair is answered from the
  samples it has and only the missing ones are requested. With a `cache_dir` (the state folder's cache/, as the
  server and `eval` give it) each is also appended to a file there at once, under the model, prompt version and
  output mode: a restarted server, or an `eval` rerun after a Ctrl-C, reuses them without a request; another
  model or prompt asks again, while a larger `samples` asks only for the samples it lacks (each is an independent
  draw of the same prompt); that folder is bounded (ANSWERS_CACHE_BYTES), least recently used pairs first, never
  a pair a call is asking for;
- a request already sent when its call stops waiting (the time limit) is not cancelled (the API bills it all
  the same): it finishes in the background, its usage is recorded and its answer kept for the pair's next call;
- batches stopped midway (Ctrl-C, a failed creation, an API error) are cancelled (together, within a few seconds;
  a cancel not confirmed is logged), then what they had finished (billed all the same) is read for a few seconds:
  its usage recorded and its answers kept for a rerun;
- a call for a pair another call is asking for at that moment (parallel compares, a client's retry) waits for that
  pair's answers (within its own limit; until the pair has all its samples or the other call ends, not for the
  other call's other pairs) instead of paying for its own, its other pairs sent meanwhile; stopped while waiting (the
  limit), it answers that pair from what is kept of it; a pair a call holds twice (the same prompt: a pairs file's
  repeat) is asked once, and every copy gets that answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import anyio

from forecaster_mcp import bins
from forecaster_mcp.disk_cache import WritesSinceScan, evict_least_recent
from forecaster_mcp.forecast import prompt
from forecaster_mcp.forecast.base import USAGE_LEDGER, BinForecast, PairQuery, PartialForecast
from forecaster_mcp.models import Kernel

if TYPE_CHECKING:
    import httpx2
    from anthropic import AsyncAnthropic
    from anthropic.types import Message, Usage

log = logging.getLogger(__name__)

FORBID_REAL_API_ENV = "FORECASTER_MCP_FORBID_REAL_API"
OutputMode = Literal["auto", "tool", "json"]
_T = TypeVar("_T")
_L = TypeVar("_L", bound=list[Any])

# Models documented to reject a forced tool_choice (400): they get the JSON-schema output format instead.
# Any other model that rejects it is switched at run time on the first such error.
_NO_FORCED_TOOL_PREFIXES = (
    "claude-fable-5-2",
    "claude-mythos-5-2",
    "claude-opus-5-5",
    "claude-sonnet-5-5",
    "claude-haiku-5-5",
    "claude-fable-5-1",
    "claude-mythos-5-1",
)
# The prompt cache lives 5 minutes from its last use; re-warm a little before that.
_CACHE_TTL_S = 270.0
# Polls a cancelled batch gets to end (so what it finished can be read) before its results are given up.
_CANCEL_POLLS = 3
_RESULTS_READS = 3  # attempts at one ended batch's results download (_read_results)
# How long a stop (Ctrl-C, a failed batch creation, an API error) waits, after cancelling its batches, to read what
# they had finished: those requests are billed, and read they are recorded and kept (a rerun does not pay again).
_STOP_READ_WAIT_S = 10.0
# How long a stop waits for its batches' cancels, sent together, each once (no SDK retries) and with this timeout:
# a stalled API held a Ctrl-C minutes per batch (the SDK's 120 s timeout and its retries, one batch after another).
CANCEL_WAIT_S = 5.0
# Message Batches limits: 100,000 requests and 256 MB per batch; stay well under both.
_BATCH_MAX_REQUESTS = 10_000
_BATCH_MAX_BYTES = 100 * 2**20
# After a call in which the API could not be reached at all, calls skip Claude for this long (a server's every
# compare, an evaluation's every chunk, waited out the SDK's retries against a dead endpoint).
UNREACHABLE_PAUSE_S = 60.0
_UNREACHABLE = "the Anthropic API could not be reached after retries"
# The SDK (2.x) waits out whatever retry-after a 429 or 5xx names before its retry, without bound (0.x waited at
# most 60 s): "retry-after: 3600" (a rate, ramp or spend limit) held one request an hour, every compare to its
# forecast_timeout_s and an evaluation's chunk without a time limit to the hour. A longer wait than this is not
# waited: the request fails at once, and later calls skip Claude until the API's wait is over (at most
# RETRY_AFTER_PAUSE_MAX_S at a time; then one call asks again).
MAX_RETRY_AFTER_S = 60.0
RETRY_AFTER_PAUSE_MAX_S = 600.0
# ptxas for the prompt: at most this many kernels a call (a screening call's dozens would hold Claude's
# answer back), each compile bounded.
MAX_PTXAS_KERNELS = 8
_PTXAS_WAIT_S = 20.0
# Complete answers kept per pair text (least recently used dropped first): a pair asked again is answered as before.
_ANSWERS_KEPT = 4096
# Under cache_dir: one file of JSON lines per pair and answer settings, a line per sample (_AnswerFiles).
ANSWERS_DIR = "claude-answers"
# Its bound (about 1 KB a sample: a quarter of a million samples); it grew without end. Past it the least recently
# used pairs go (a use touches a pair's file; forecaster_mcp.disk_cache), down to ANSWERS_CACHE_LOW_WATER of it,
# never a pair a call of this process is asking for (_ANSWERS_IN_USE): a later process would pay again for them.
ANSWERS_CACHE_BYTES = 256 << 20
ANSWERS_CACHE_LOW_WATER = 0.8
# Shared blocks (baselines) whose time in the prompt cache is kept track of.
_SHARED_WARM_KEPT = 1024
# How long aclose waits for requests still running in the background before it cancels them.
CLOSE_WAIT_S = 3.0
# The part of a call's time left that its other requests wait for a warm-up request (_warm_up_wait_s).
_WARM_UP_SHARE = 0.5
_TRANSIENT_BATCH_ERRORS = {"rate_limit_error", "api_error", "overloaded_error", "timeout_error"}


def _transient_api_error(an: Any, exc: BaseException) -> bool:
    """A failure worth trying again later: the connection (a reset, a timeout), a rate limit, a server error."""
    import httpx2

    if isinstance(exc, (an.APIConnectionError, httpx2.TransportError)):
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and (status == 429 or status >= 500)


def _retry_after_s(headers: Any) -> float | None:
    """The wait a response's retry-after-ms or retry-after header names, in seconds (None: none, or unreadable),
    read as the SDK reads them: milliseconds, seconds, or an HTTP date."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            if name == "retry-after-ms":
                continue
            import email.utils

            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError, IndexError):
                return None
            if when.tzinfo is None:
                return None
            return when.timestamp() - time.time()
        return seconds if math.isfinite(seconds) else None
    return None


async def _bound_retry_after(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """SDK middleware (it runs once per attempt, inside the SDK's retry loop): an error response that names a wait
    over MAX_RETRY_AFTER_S is marked not to be retried (`x-should-retry: false`, which the SDK obeys), so the
    SDK raises it at once instead of sleeping that long."""
    response = await call_next(request)
    http = getattr(response, "http_response", None)
    if http is not None and http.status_code >= 400:
        wait = _retry_after_s(http.headers)
        if wait is not None and wait > MAX_RETRY_AFTER_S:
            http.headers["x-should-retry"] = "false"
    return response


# Refusals of the whole account that the API sends as a 400 or a 429 (told apart by error.details.error_code, which
# SDK 2.x raises as subclasses of BadRequestError and RateLimitError): every other request would be refused too, so
# the call stops at the first, saying what to do. Read as one request's problem, each call sent every request (the
# 429s each retried by the SDK, 1.5 s of backoff apiece without a retry-after) for a note that said only the class.
_ACCOUNT_REFUSALS = {
    "organization_on_hold": "Anthropic has put the organization on hold (see the Anthropic Console); unset the API "
    "key to forecast without Claude",
    "enforced_spend_limit_reached": "the Anthropic organization has used its API tier's monthly spend: raise the "
    "limit in the Anthropic Console, or unset the API key to forecast without Claude",
    "contract_spend_limit_reached": "the Anthropic organization has reached its contract's spend limit: raise it "
    "with Anthropic, or unset the API key to forecast without Claude",
}


def _error_code(exc: Exception) -> str | None:
    """The API error's error.details.error_code (SDK 2.x keeps it as `error_code`; read from the body otherwise)."""
    code = getattr(exc, "error_code", None)
    if isinstance(code, str):
        return code
    body = getattr(exc, "body", None)
    error = body.get("error") if isinstance(body, dict) else None
    details = error.get("details") if isinstance(error, dict) else None
    code = details.get("error_code") if isinstance(details, dict) else None
    return code if isinstance(code, str) else None


class ClaudeUnavailable(PartialForecast):
    """Claude gave no usable forecast (no key, API failure, or every sample invalid for some pair).

    `partial` holds the forecasts that did succeed, in query order (None where a pair failed), so a
    bulk evaluation keeps what it paid for.
    """


class RealApiCallForbidden(RuntimeError):
    """A test built a ClaudeForecaster that would call the real, paid API."""


class UsageSink(Protocol):
    """Where token usage and its cost are recorded (the Store implements this)."""

    async def record_llm_usage(
        self,
        *,
        ledger: str | None,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cache_read_tokens: int,
        cache_write_tokens: int,
        cost_usd: float,
    ) -> None: ...


# ---------------------------------------------------------------- prices


@dataclass(frozen=True)
class ModelPrice:
    """USD per million tokens. cache_write is the 5-minute cache write (1.25x input on most models)."""

    input: float
    output: float
    cache_write: float
    cache_read: float


# From platform.claude.com/docs/en/about-claude/pricing (checked against the model pages, October 2026; Fable and
# Mythos 5.2, released 2026-11-09, at their list price: 20% below 5.1).
# Haiku 5.5 has a second, higher band for prompts over 100k tokens (LONG_PROMPT_PRICES).
PRICES: dict[str, ModelPrice] = {
    "claude-fable-5-2": ModelPrice(8.0, 40.0, 10.0, 0.20),
    "claude-mythos-5-2": ModelPrice(8.0, 40.0, 10.0, 0.20),
    "claude-fable-5-1": ModelPrice(10.0, 50.0, 12.5, 0.25),
    "claude-mythos-5-1": ModelPrice(10.0, 50.0, 12.5, 0.25),
    "claude-fable-5": ModelPrice(10.0, 50.0, 12.5, 1.0),
    "claude-mythos-5": ModelPrice(10.0, 50.0, 12.5, 1.0),
    "claude-opus-5-5": ModelPrice(4.0, 20.0, 5.0, 0.20),
    "claude-opus-5": ModelPrice(5.0, 25.0, 6.25, 0.50),
    "claude-opus-4-8": ModelPrice(5.0, 25.0, 6.25, 0.50),
    "claude-opus-4-7": ModelPrice(5.0, 25.0, 6.25, 0.50),
    "claude-opus-4-6": ModelPrice(5.0, 25.0, 6.25, 0.50),
    "claude-opus-4-5": ModelPrice(5.0, 25.0, 6.25, 0.50),
    "claude-opus-4-1": ModelPrice(15.0, 75.0, 18.75, 1.50),
    "claude-opus-4-0": ModelPrice(15.0, 75.0, 18.75, 1.50),
    "claude-opus-4": ModelPrice(15.0, 75.0, 18.75, 1.50),
    "claude-sonnet-5-5": ModelPrice(2.0, 10.0, 2.5, 0.10),  # cache reads cut from 0.20 on 2026-10-07
    "claude-sonnet-5": ModelPrice(2.0, 10.0, 2.5, 0.20),
    "claude-sonnet-4-6": ModelPrice(3.0, 15.0, 3.75, 0.30),
    "claude-sonnet-4-5": ModelPrice(3.0, 15.0, 3.75, 0.30),
    "claude-sonnet-4-0": ModelPrice(3.0, 15.0, 3.75, 0.30),
    "claude-sonnet-4": ModelPrice(3.0, 15.0, 3.75, 0.30),
    "claude-3-7-sonnet": ModelPrice(3.0, 15.0, 3.75, 0.30),
    "claude-haiku-5-5": ModelPrice(0.10, 0.50, 0.125, 0.01),
    "claude-haiku-4-5": ModelPrice(1.0, 5.0, 1.25, 0.10),
    "claude-3-5-haiku": ModelPrice(0.80, 4.0, 1.0, 0.08),
}
# A request whose prompt (input, cache reads and writes) is over LONG_PROMPT_TOKENS is billed, all its tokens,
# output included, at the model's long-prompt band. A pair near prompt.MAX_PROMPT_BYTES can get there.
LONG_PROMPT_TOKENS = 100_000
LONG_PROMPT_PRICES: dict[str, ModelPrice] = {"claude-haiku-5-5": ModelPrice(0.50, 2.50, 0.625, 0.05)}
BATCH_DISCOUNT = 0.5  # the Batches API bills every token category at half price
_warned_unknown: set[str] = set()


def _price_key(model: str) -> str | None:
    """The PRICES key of a model id, allowing a date or alias suffix (`claude-sonnet-4-5-20250929`,
    `claude-3-5-haiku-latest`)."""
    if model in PRICES:
        return model
    for key in sorted(PRICES, key=len, reverse=True):
        if model.startswith(key) and re.fullmatch(r"(-\d{8}|-latest)?(-v\d+(:\d+)?)?", model[len(key) :]):
            return key
    return None


def price_for(model: str) -> ModelPrice | None:
    """The price row of a model id (a date or alias suffix allowed)."""
    key = _price_key(model)
    return None if key is None else PRICES[key]


@dataclass
class TokenUsage:
    """Tokens spent (summed over requests). `long` holds, within these sums, the tokens of requests whose prompt
    was over LONG_PROMPT_TOKENS (a model with a long-prompt band bills all of such a request's tokens there)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    requests: int = 0
    long: TokenUsage | None = None

    def add_usage(self, usage: Usage | None) -> None:
        """One answered request. The SDK does not validate response bodies: a field (or the whole usage
        block) may be missing from a malformed one, and counts as 0 (the request still counts)."""
        one = TokenUsage(
            _tokens(usage, "input_tokens"),
            _tokens(usage, "output_tokens"),
            _tokens(usage, "cache_read_input_tokens"),
            _tokens(usage, "cache_creation_input_tokens"),
            1,
        )
        if one.input_tokens + one.cache_read_tokens + one.cache_write_tokens > LONG_PROMPT_TOKENS:
            one.long = replace(one)
        self.add(one)

    def add(self, other: TokenUsage) -> None:
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cache_read_tokens += other.cache_read_tokens
        self.cache_write_tokens += other.cache_write_tokens
        self.requests += other.requests
        if other.long is not None:
            if self.long is None:
                self.long = TokenUsage()
            self.long.add(other.long)


def _tokens(usage: object, name: str) -> int:
    value = getattr(usage, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def cost_usd(model: str, usage: TokenUsage, *, batch: bool = False) -> float:
    """Dollar cost of `usage`; 0 with a warning (once per model) when the model's price is unknown."""
    price = price_for(model)
    if price is None:
        if model not in _warned_unknown:
            _warned_unknown.add(model)
            log.warning("no price known for model %r: its usage is recorded with cost 0", model)
        return 0.0
    dollars = _dollars(usage, price)
    long_price = LONG_PROMPT_PRICES.get(_price_key(model) or "")
    if long_price is not None and usage.long is not None:
        # Those requests' tokens at the long-prompt band instead.
        dollars += _dollars(usage.long, long_price) - _dollars(usage.long, price)
    return dollars * (BATCH_DISCOUNT if batch else 1.0)


def _dollars(usage: TokenUsage, price: ModelPrice) -> float:
    return (
        usage.input_tokens * price.input
        + usage.output_tokens * price.output
        + usage.cache_read_tokens * price.cache_read
        + usage.cache_write_tokens * price.cache_write
    ) / 1e6


# ---------------------------------------------------------------- answers


@dataclass(frozen=True)
class _Sample:
    probs: list[float]
    reasoning: str


class _Truncated(prompt.InvalidAnswer):
    """Output hit max_tokens before the answer was complete: retried with a larger max_tokens."""


class _Dropped(Exception):
    """An answer that retrying would not fix (a refusal, a prompt over the context window)."""


# The API's 400 for a request over the model's context window: about that one prompt, not the account.
_PROMPT_TOO_LONG = "prompt is too long"


class _Transient(Exception):
    """An API failure left after the SDK's own retries (rate limits, overload, connection)."""


class ClaudeForecaster:
    """Claude forecasts the 8-bin speedup distribution of each pair (see the module docstring)."""

    name = "claude"
    remote = True  # answers over the network: the engine's timeout applies
    paid = True  # bills per request: a server records its usage on the caller's ledger, which must exist
    # A model's stated probabilities are not trusted as they are until verified pairs calibrate them: before
    # that its log-odds count 0.4 times (a claimed 0.9 counts as 0.7, a claimed 1.0 as 0.98), and its fits
    # start from there. Otherwise one answer of "surely faster", which a kernel's comments can talk it into,
    # decided a verdict the local forecaster was unsure of (combined p 0.99 against a 0.95 threshold).
    calibration_slope = 0.4

    def __init__(
        self,
        api_key: str,
        model: str,
        samples: int = 3,
        usage_sink: UsageSink | None = None,
        http_client: httpx2.AsyncClient | None = None,
        max_concurrency: int = 8,
        *,
        ledger: str | None = None,
        max_retries: int = 2,
        invalid_retries: int = 2,
        output_mode: OutputMode = "auto",
        max_tokens: int | None = None,
        request_timeout_s: float = 120.0,
        features: prompt.FeaturesFn | Literal["auto"] | None = "auto",
        warm_cache: bool = True,
        batch_poll_interval_s: float = 30.0,
        batch_max_wait_s: float = 25 * 3600.0,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        time_limit_s: float | None = None,
        nvcc: str | None = None,
        cache_dir: Path | None = None,
        max_ptxas_kernels: int = MAX_PTXAS_KERNELS,
        ptxas_wait_s: float = _PTXAS_WAIT_S,
    ) -> None:
        if http_client is None and os.environ.get(FORBID_REAL_API_ENV) == "1":
            raise RealApiCallForbidden(
                f"REFUSING TO CALL THE REAL ANTHROPIC API: {FORBID_REAL_API_ENV}=1 is set (tests) and no "
                "http_client was injected. Pass "
                "http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler))."
            )
        if http_client is None and not api_key:
            raise ClaudeUnavailable(
                "no Anthropic API key: set FORECASTER_MCP_ANTHROPIC_API_KEY (or ANTHROPIC_API_KEY) "
                "to use Claude"
            )
        if samples < 1 or max_concurrency < 1 or invalid_retries < 0:
            raise ValueError("samples and max_concurrency must be >= 1, invalid_retries >= 0")
        import anthropic  # lazily: see the module docstring

        self._anthropic = anthropic
        self._client: AsyncAnthropic = anthropic.AsyncAnthropic(
            api_key=api_key or "injected-http-client",
            http_client=http_client,
            max_retries=max_retries,
            timeout=request_timeout_s,
            middleware=[_bound_retry_after],
        )
        self.model = model
        self.version = model
        self.samples = samples
        self.ledger = ledger
        self.invalid_retries = invalid_retries
        self._usage_sink = usage_sink
        # Held by each request from its sending to its end, also one finishing in the background: at most
        # max_concurrency requests run, so the background ones are bounded too.
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._request_timeout_s = request_timeout_s
        self._output_mode = output_mode
        self._mode: Literal["tool", "json"] = (
            output_mode
            if output_mode != "auto"
            else ("json" if model.startswith(_NO_FORCED_TOOL_PREFIXES) else "tool")
        )
        self._max_tokens_override = max_tokens
        self._features: prompt.FeaturesFn | Literal["auto"] | None = features
        self._warm_cache = warm_cache
        self._cache_warm_until = 0.0  # of the system prompt
        # Per shared block (a baseline on a GPU and workload), by its hash: until when the cache holds it.
        self._shared_warm_until: OrderedDict[str, float] = OrderedDict()
        # Per shared block, by its hash: until when a request that sent it (marked or not) is recent enough that
        # another request for it is likely, and the block worth the cache write (`_marked`).
        self._shared_sent_until: OrderedDict[str, float] = OrderedDict()
        # What the API's usage said of earlier warm-ups: a prompt below the model's minimum cacheable length is
        # neither written nor read, and a warm-up for it only holds the other requests back. The prefix up to the
        # shared block grows with that block's text (the system prompt is the same in every request), and up to
        # a pair's own block with the pair's text: no longer than one that cached nothing, none caches anything.
        self._shared_uncacheable_chars = -1
        self._pair_uncacheable_chars = 0
        self._batch_poll_interval_s = batch_poll_interval_s
        self._batch_max_wait_s = batch_max_wait_s
        self._sleep = sleep or asyncio.sleep
        # compare_kernels' bound on one call (forecast_timeout_s); the engine's own timeout is a backstop.
        self.time_limit_s = time_limit_s
        self._unreachable: tuple[float, str] | None = None  # (until when calls skip Claude, why)
        # (until when calls skip Claude, why): the API asked for a wait over MAX_RETRY_AFTER_S.
        self._told_to_wait: tuple[float, str] | None = None
        # With nvcc, the prompt's static features carry ptxas's registers, shared memory and spills.
        self._nvcc = nvcc
        self._cache_dir = cache_dir
        # An evaluation compiles every kernel of its file (forecaster-mcp eval), as the server compiles a compare's.
        self._max_ptxas_kernels = max_ptxas_kernels
        self._ptxas_wait_s = ptxas_wait_s
        self.usage_total = TokenUsage()
        self.cost_usd_total = 0.0
        # Every answered sample on disk as it arrives, for later processes (None: memory only).
        self._answer_files = (
            _AnswerFiles(cache_dir / ANSWERS_DIR, model, samples, output_mode)
            if cache_dir is not None
            else None
        )
        # The samples of each pair answered in full, by the hash of its prompt (the model and system prompt are
        # this forecaster's own): the same compare sent again (say with measure_if_unsure this time) paid for
        # every sample a second time, and a new draw could turn a decided verdict unsure between the two calls.
        self._answers: OrderedDict[str, tuple[_Sample, ...]] = OrderedDict()
        # Samples answered after their call had returned (_finish_late), by the same hash: paid for, they are the
        # first samples of the pair's next call.
        self._late_answers: OrderedDict[str, list[_Sample]] = OrderedDict()
        # The tasks finishing requests whose call stopped waiting for them (_finish_late), by the same hash: owned
        # here, so that they are not collected mid-run; the pair's next call waits for them instead of paying for
        # new requests (forecast), and aclose waits for them all (_background).
        self._late_running: dict[str, set[asyncio.Task[None]]] = {}
        # The pairs a call is asking for now (_claim), by the same hash: another call for one of them waits for the
        # pair's future, done once the pair has all its samples (_settled) or the call ends (_release).
        self._asking: dict[str, asyncio.Future[None]] = {}

    @property
    def _background(self) -> set[asyncio.Task[None]]:
        """Every task still finishing a request in the background."""
        return {t for running in self._late_running.values() for t in running}

    # ------------------------------------------------------------ public

    async def forecast(self, queries: Sequence[PairQuery]) -> list[BinForecast]:
        """One BinForecast per query. ClaudeUnavailable when some pair got no usable sample.

        After `time_limit_s` the call returns: the pairs answered so far (a pair with fewer samples than asked is
        aggregated from those it has) are kept in the exception's `partial`, they are paid for; the requests
        still running finish in the background (their usage recorded, their answers kept for the next call)."""
        self._refuse_while_unreachable()
        usage = TokenUsage()
        problems: list[str] = []
        got: list[list[_Sample | None]] = [[] for _ in queries]
        texts: list[prompt.PairPrompt] = []
        keys: list[str] = []
        asking: dict[str, asyncio.Future[None]] = {}
        held: list[str] = []  # the call's pairs' answer files, spared by the folder's eviction
        # The pairs waiting for another call's answers (after_others), not yet given what is kept of them.
        waiting: set[int] = set()

        def kept_of_waiting() -> None:
            # Stopped while waiting (the limit, a refused key): what is kept of those pairs is theirs.
            for i in sorted(waiting):
                got[i].extend(self._answered(keys[i]))
            waiting.clear()

        def ask(now: Sequence[int], deadline: float) -> Coroutine[Any, Any, object]:
            """Send the pairs `now` (firsts of their prompts), less what is kept of them. Claimed at once, before
            anything is awaited: a call checking the claims meanwhile sees them."""
            for i in now:
                got[i].extend(self._answered(keys[i]))
            fits = [
                i
                for i in now
                if prompt.utf8_size(texts[i].text) <= prompt.MAX_PROMPT_BYTES and len(got[i]) < self.samples
            ]
            asking.update(self._claim([keys[i] for i in fits]))
            marked = self._marked(texts, [(i, self.samples - len(got[i])) for i in fits])

            def pairs() -> list[Coroutine[Any, Any, None]]:
                return [self._forecast_one(marked[i], usage, problems, got[i], deadline) for i in now]

            if fits and self._warm_cache:
                return self._warm_up_shared(marked, fits, usage, problems, got, deadline, pairs)
            return _gather_or_cancel(pairs())

        async def after_others(i: int, deadline: float) -> None:
            # A request an earlier call gave up on and still running, or another call asking for the same pair
            # right now, is paid for: wait for their answers (within this call's limit) rather than send and pay
            # for more. This call's other pairs are sent meanwhile.
            while waits := self._paid_meanwhile([keys[i]]):
                await asyncio.wait(waits)
            waiting.discard(i)
            await ask([i], deadline)  # no await since the wait: none asked meanwhile

        try:
            limit = math.inf if self.time_limit_s is None else self.time_limit_s
            deadline = time.monotonic() + limit
            # The limit counts from the call: building the prompts (ptxas, features) is inside it too.
            with anyio.move_on_after(limit) as scope:
                texts = await self._prompts(queries)
                keys = [_answer_key(p) for p in texts]
                held = self._hold(keys)  # before any is read
                once = _share_copies(keys, got)
                waiting.update(i for i in once if self._paid_meanwhile([keys[i]]))
                try:
                    await _gather_or_cancel(
                        [
                            ask([i for i in once if i not in waiting], deadline),
                            *(after_others(i, deadline) for i in sorted(waiting)),
                        ]
                    )
                except ClaudeUnavailable as exc:
                    # The key or model was refused mid-call: the answers already in are paid for; keep them.
                    kept_of_waiting()
                    raise ClaudeUnavailable(str(exc), partial=[self._aggregated(g) for g in got]) from exc
            kept_of_waiting()
            if scope.cancelled_caught:
                # The engine's note keeps about the first 130 characters of this: what matters comes first.
                problems.append(
                    f"Claude did not finish within {limit:g} s (forecast_timeout_s): requests sent end in the "
                    "background, billed, answers kept for a next call; raise the limit for compares of many "
                    "candidates, or lower claude_samples"
                )
        finally:
            # Kept before anything is awaited: a call cancelled here (Ctrl-C, a client's cancel) keeps them too.
            # (Once a pair: its copies share its samples.)
            for key, g in dict(zip(keys, got, strict=False)).items():
                self._remember(key, g)
            self._release(asking)
            self._let_go(held)
            with anyio.CancelScope(shield=True):  # a timed-out call still paid for what it got
                await self._record(usage, batch=False)
        await self._bound_answers()
        results = [self._aggregated(g) for g in got]
        if queries and not any(results) and any(p.startswith(_UNREACHABLE) for p in problems):
            # Nothing answered and the API could not be reached (after the SDK's retries): the next calls
            # skip Claude at once for a while instead of each waiting out the same retries again.
            # Quoted: the problem that made it unreachable, not the call's last one (a refused request, the limit).
            why = next(p for p in reversed(problems) if p.startswith(_UNREACHABLE))
            self._unreachable = (time.monotonic() + UNREACHABLE_PAUSE_S, why)
        return self._finish(results, problems)

    async def _warm_up_shared(
        self,
        texts: Sequence[prompt.PairPrompt],
        fits: Sequence[int],
        usage: TokenUsage,
        problems: list[str],
        got: list[list[_Sample | None]],
        deadline: float,
        pairs: Callable[[], Sequence[Coroutine[Any, Any, None]]],
    ) -> None:
        """The call's requests (`pairs`), after warm-up requests that let them read the cache instead of each writing
        the same prefix: while the system prompt is cold, one request alone (it writes the system prompt that every
        other request reads, and its pair's shared block); then, together, one request for each other shared
        block (a baseline) that more than one pending request of the call sends and the cache does not hold. Each
        warm-up is waited for only so long (`_after_warm_ups`)."""
        now = time.monotonic()
        first = fits[0]
        warm_first = []
        if now >= self._cache_warm_until and len(texts[first].shared) > self._shared_uncacheable_chars:
            warm_first = [self._warm_up(texts[first], usage, problems, got[first])]

        def shared_warm_ups() -> list[Coroutine[Any, Any, None]]:
            left: dict[str, list[int]] = {}
            for i in fits:
                if len(got[i]) < self.samples:
                    left.setdefault(texts[i].shared, []).append(i)
            now = time.monotonic()
            todo = [
                sending[0]
                for shared, sending in left.items()
                if sum(self.samples - len(got[i]) for i in sending) > 1
                and len(shared) > self._shared_uncacheable_chars
                and self._shared_warm_until.get(_digest(shared), 0.0) <= now
            ]
            return [self._warm_up(texts[i], usage, problems, got[i]) for i in todo]

        def after_first() -> list[Coroutine[Any, Any, None]]:
            return [_after_warm_ups(shared_warm_ups(), _warm_up_wait_s(deadline), pairs)]

        await _after_warm_ups(warm_first, _warm_up_wait_s(deadline), after_first)

    def _marked(
        self, texts: Sequence[prompt.PairPrompt], sends: Sequence[tuple[int, int]]
    ) -> list[prompt.PairPrompt]:
        """`texts` with their shared block marked for caching where another request will read it: more than one
        of the requests about to be sent (`sends`: (text, how many requests)) carries it, or a request sent it a
        cache lifetime ago or less (a search comparing candidates against its current best one at a time). A
        block only this request sends is not marked: its cache write costs 1.25x its input price, and nothing
        would read it (an evaluation's pairs, each against a baseline of its own, paid a quarter more for each)."""
        count: dict[str, int] = {}
        for i, n in sends:
            count[texts[i].shared] = count.get(texts[i].shared, 0) + n
        now = time.monotonic()
        return [
            replace(
                p,
                cache_shared=count.get(p.shared, 0) > 1
                or self._shared_sent_until.get(_digest(p.shared), 0.0) > now,
            )
            for p in texts
        ]

    @property
    def answers_dir(self) -> Path | None:
        """Where answered samples are kept for later processes (None: in memory only)."""
        return None if self._answer_files is None else self._answer_files.folder

    @property
    def answers_saved(self) -> int:
        """Samples this forecaster appended to `answers_dir`."""
        return 0 if self._answer_files is None else self._answer_files.saved

    @property
    def answers_reused(self) -> int:
        """Samples this forecaster read from `answers_dir` (kept by an earlier process) instead of asking again."""
        return 0 if self._answer_files is None else self._answer_files.reused

    def _answered(self, key: str) -> tuple[_Sample, ...]:
        """The samples of an earlier complete answer to this prompt, else those kept of an incomplete one (answered
        in the background, by a call stopped or refused midway, or by an earlier process: `_answer_files`).
        `key`: the pair's `_answer_key`."""
        samples = self._answers.get(key, ())
        if samples:
            self._answers.move_to_end(key)
            if self._answer_files is not None:
                self._answer_files.touch(key)  # used: not among the least recently used on disk
            return samples
        kept = tuple(self._late_answers.get(key, ()))
        if self._answer_files is not None:
            # Every sample this process got is there too (unless its write failed): the longer one.
            stored = self._answer_files.read(key)
            if len(stored) > len(kept):
                kept = stored
                self._keep(key, kept)
        return kept[: self.samples]

    def _paid_meanwhile(self, keys: Sequence[str]) -> set[asyncio.Future[Any]]:
        """What to wait for before asking for the pairs `keys`: requests an earlier call gave up on that still
        run, and other calls asking for one of them now (`_claim`)."""
        waits: set[asyncio.Future[Any]] = set()
        for key in set(keys):
            waits.update(self._late_running.get(key, ()))
            if (other := self._asking.get(key)) is not None:
                waits.add(other)
        return waits

    def _claim(self, keys: Sequence[str]) -> dict[str, asyncio.Future[None]]:
        """The pairs `keys` as being asked by this call, each until it has all its samples (`_settled`) or the
        call ends (`_release`): another call asking for one of them meanwhile waits for that pair's answers instead
        of paying for its own. A future per pair: a call waiting for one pair of a compare of many, whose other
        pairs run to the time limit, was held to the limit too and sent its own pairs too late."""
        loop = asyncio.get_running_loop()
        claims: dict[str, asyncio.Future[None]] = {key: loop.create_future() for key in keys}
        self._asking.update(claims)
        return claims

    def _release(self, claims: dict[str, asyncio.Future[None]]) -> None:
        """The end of a call's `_claim`, once its answers are kept (`_remember`)."""
        for key, done in claims.items():
            if self._asking.get(key) is done:
                del self._asking[key]
            if not done.done():
                done.set_result(None)

    def _settled(self, text: prompt.PairPrompt, got: Sequence[_Sample | None]) -> None:
        """A sample of the pair `text` has come in `got`: once the pair has all it asks for (none still in flight
        then), it is kept, and a call waiting for it goes on. Only the call that claimed a pair sends its
        requests."""
        if sum(s is not None for s in got) < self.samples:
            return
        key = _answer_key(text)
        self._remember(key, got)
        done = self._asking.pop(key, None)
        if done is not None and not done.done():
            done.set_result(None)

    def _keep_late(self, key: str, sample: _Sample) -> None:
        """Keep a sample answered after its call had returned, for the pair's next call (_answered)."""
        if key in self._answers:
            return
        kept = self._late_answers.setdefault(key, [])
        if len(kept) < self.samples:
            kept.append(sample)
            self._save(key, sample)
        self._late_answers.move_to_end(key)
        while len(self._late_answers) > _ANSWERS_KEPT:
            self._late_answers.popitem(last=False)

    def _save(self, key: str, sample: _Sample) -> None:
        """An answered sample, on disk at once (before anything else can stop this process's work on it)."""
        if self._answer_files is not None:
            self._answer_files.append(key, sample)

    def _hold(self, keys: Sequence[str]) -> list[str]:
        """The answer files of the pairs `keys`, spared by the folder's eviction until `_let_go`."""
        return [] if self._answer_files is None else _ANSWERS_IN_USE.hold(self._answer_files.paths(keys))

    def _let_go(self, held: list[str]) -> None:
        _ANSWERS_IN_USE.let_go(held)
        held.clear()

    async def _bound_answers(self) -> None:
        """Keep the answers folder to ANSWERS_CACHE_BYTES when enough was written to it since its last scan."""
        files = self._answer_files
        if files is None or not files.scan_due:
            return
        files.scan_due = False
        await anyio.to_thread.run_sync(
            functools.partial(
                evict_least_recent,
                files.folder,
                ANSWERS_CACHE_BYTES,
                ANSWERS_CACHE_LOW_WATER,
                what="Claude answers folder",
                spare=_ANSWERS_IN_USE.__contains__,
                spare_lock=_ANSWERS_IN_USE.lock,
            )
        )

    def _remember(self, key: str, got: Sequence[_Sample | None]) -> None:
        """Keep a pair's samples: once it has all it asked for, as its answer; fewer (a refused sample, a call
        stopped midway), as the first of its next call's, which asks only for the rest."""
        samples = tuple(s for s in got if s is not None)
        if not samples:
            return
        if len(samples) < self.samples:
            # Samples answered in the background meanwhile are kept beside this call's (never twice).
            late = self._late_answers.get(key, [])
            samples += tuple(s for s in late if not any(s is t for t in samples))
        self._keep(key, samples)

    def _keep(self, key: str, samples: Sequence[_Sample]) -> None:
        """`samples` as all that is known of the pair `key` (`_answers` once complete, else `_late_answers`)."""
        if len(samples) < self.samples:
            self._late_answers[key] = list(samples)
            self._late_answers.move_to_end(key)
            while len(self._late_answers) > _ANSWERS_KEPT:
                self._late_answers.popitem(last=False)
            return
        self._late_answers.pop(key, None)  # among `samples` now
        self._answers[key] = tuple(samples[: self.samples])
        self._answers.move_to_end(key)
        while len(self._answers) > _ANSWERS_KEPT:
            self._answers.popitem(last=False)

    def _refuse_while_unreachable(self) -> None:
        if self._told_to_wait is not None:
            until, why = self._told_to_wait
            left = until - time.monotonic()
            if left > 0:
                raise ClaudeUnavailable(f"{why}; not asked again for {left:.0f} s")
            self._told_to_wait = None
        if self._unreachable is not None:
            until, why = self._unreachable
            if time.monotonic() < until:
                raise ClaudeUnavailable(
                    f"the Anthropic API could not be reached on an earlier call ({' '.join(why.split())[:200]}); not "
                    f"tried again for {UNREACHABLE_PAUSE_S:.0f} s"
                )
            self._unreachable = None

    async def forecast_batch(self, queries: Sequence[PairQuery]) -> list[BinForecast]:
        """Forecast many pairs through the Message Batches API (half price, minutes to hours).

        Every (pair, sample) is one batch request; unusable answers are resubmitted in up to
        `invalid_retries` further batches. Polls every `batch_poll_interval_s` for at most `batch_max_wait_s`.
        A line of the results that cannot be read (not JSON, cut short, a result type this code does not know)
        leaves its sample unanswered (not resubmitted); every other result is kept, and those lines are counted
        and named in the warning logged and in the exception's message when some pair goes unanswered.
        """
        usage = TokenUsage()
        problems: list[str] = []
        samples: list[list[_Sample]] = [[] for _ in queries]
        unreadable: list[str] = []  # the requests whose result line could not be read, named
        texts: list[prompt.PairPrompt] = []
        keys: list[str] = []  # each text's _answer_key
        held: list[str] = []  # their answer files, spared by the folder's eviction

        def unanswered(message: str) -> ClaudeUnavailable:
            if unreadable:
                message = f"{_unreadable_note(unreadable)}; {message}"
            return ClaudeUnavailable(message, partial=[self._aggregate(s) if s else None for s in samples])

        def take(
            outcomes: dict[str, Any],
            round_no: int,
            pending: dict[tuple[int, int], int],
            mode: Literal["tool", "json"],
            requests: dict[str, Any],
            retry: dict[tuple[int, int], int],
        ) -> ClaudeUnavailable | None:
            """A round's results: each sample answered is kept (on disk at once) and its tokens counted, each
            unusable one put in `retry`. Returns the refusal of the account or model, if one came."""
            rejected: ClaudeUnavailable | None = None
            for (i, j), max_tokens in pending.items():
                outcome = outcomes.get(f"q{i}-s{j}-r{round_no}")
                if isinstance(outcome, _Unreadable):
                    q = queries[i]
                    unreadable.append(
                        f"pair {i + 1} ({q.candidate.id or '-'} vs {q.baseline.id or '-'}) sample {j + 1}: "
                        f"{outcome.why}"
                    )
                    continue
                answered = len(samples[i])
                try:
                    again = self._batch_outcome(outcome, mode, max_tokens, usage, problems, samples[i])
                except ClaudeUnavailable as exc:
                    # The account or model is refused (billing, permission): no further round, but every
                    # other result of this batch is read, billed and kept.
                    rejected = rejected or exc
                    continue
                if len(samples[i]) > answered:
                    self._save(keys[i], samples[i][-1])
                if again is not None:
                    retry[(i, j)] = again
            # Lines that name no request leave one unanswered, which is then missing: asked again above.
            nameless = sum(1 for k, v in outcomes.items() if isinstance(v, _Unreadable) and k not in requests)
            if nameless:
                unreadable.append(f"{nameless} line(s) naming no request, whose requests are asked again")
            return rejected

        try:
            texts = await self._prompts(queries)
            keys = [_answer_key(p) for p in texts]
            held = self._hold(keys)  # before any is read
            once = _share_copies(keys, samples)
            for i in once:
                if prompt.utf8_size(texts[i].text) > prompt.MAX_PROMPT_BYTES:
                    problems.append(_too_long(texts[i].text))
                samples[i].extend(self._answered(keys[i]))  # kept from earlier: not asked (nor paid) again
            pending = {
                (i, j): self._max_tokens()
                for i in once
                for j in range(len(samples[i]), self.samples)
                if prompt.utf8_size(texts[i].text) <= prompt.MAX_PROMPT_BYTES
            }
            for round_no in range(1 + self.invalid_retries):
                if not pending:
                    break
                mode = self._mode
                # A retry grown from tool mode's max_tokens, when the mode was switched to JSON since, gets JSON's.
                pending = {k: max(v, self._max_tokens()) for k, v in pending.items()}
                marked = self._marked(texts, [(i, 1) for i, _ in pending])
                requests = {
                    f"q{i}-s{j}-r{round_no}": self._params(marked[i], mode, max_tokens)
                    for (i, j), max_tokens in pending.items()
                }
                outcomes: dict[str, Any] = {}
                retry: dict[tuple[int, int], int] = {}
                try:
                    gave_up = await self._run_batches(requests, outcomes)
                finally:  # also when stopped (Ctrl-C): what the stopped batches finished is paid for, kept too
                    rejected = take(outcomes, round_no, pending, mode, requests, retry)
                pending = retry
                if rejected is not None:
                    raise unanswered(str(rejected))
                if gave_up is not None:
                    # What the cancelled or failed batches finished is counted and kept; no further round.
                    raise unanswered(gave_up)
        finally:
            for key, s in dict(zip(keys, samples, strict=False)).items():
                self._remember(key, s)
            self._let_go(held)
            with anyio.CancelScope(shield=True):  # a timed-out call still paid for what it got
                await self._record(usage, batch=True)
            if unreadable:
                log.warning("%s", _unreadable_note(unreadable))
        await self._bound_answers()
        results = [self._aggregate(s) if s else None for s in samples]
        if unreadable and not all(results):
            problems.append(_unreadable_note(unreadable))  # the last problem: the one _finish names
        return self._finish(results, problems)

    async def aclose(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Close the HTTP client (also an injected one), after the requests still running in the background have
        had up to `wait_s` to end (each records its usage); those still running then are cancelled."""
        if background := self._background:
            _, running = await asyncio.wait(background, timeout=wait_s)
            if running:
                log.warning(
                    "%d Claude request(s) still running at shutdown were cancelled: if the API answered them "
                    "later, they were billed but not recorded",
                    len(running),
                )
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
        await self._client.close()

    # ------------------------------------------------------------ one pair, one sample

    async def _forecast_one(
        self,
        text: prompt.PairPrompt,
        usage: TokenUsage,
        problems: list[str],
        got: list[_Sample | None],
        deadline: float = math.inf,
    ) -> None:
        """This pair's samples, in `got` as each arrives (a timeout keeps those already in). A warm-up of this pair
        still in flight holds a place in `got` (None until it answers): no more samples than asked are sent."""
        if prompt.utf8_size(text.text) > prompt.MAX_PROMPT_BYTES:
            problems.append(_too_long(text.text))
            return
        warm = []
        if (
            not got
            and self._warm_cache
            and self.samples > 1
            and len(text.text) > self._pair_uncacheable_chars
        ):
            # The first sample writes this pair's cache entry; the others then read the long kernel text.
            warm = [self._warm_up(text, usage, problems, got)]

        async def one() -> None:
            got.append(await self._sample(text, usage, problems))
            self._settled(text, got)

        await _after_warm_ups(
            warm, _warm_up_wait_s(deadline), lambda: [one() for _ in range(self.samples - len(got))]
        )

    def _warm_up(
        self, text: prompt.PairPrompt, usage: TokenUsage, problems: list[str], got: list[_Sample | None]
    ) -> Coroutine[Any, Any, None]:
        """One sample of `text` sent alone, so that the requests after it read what it wrote to the cache. Its
        place in `got` is taken at once (None until it answers, and if it never does), so that requests of the
        same pair sent while it is still in flight count it. When its answer says nothing was cached, the prompt
        up to its shared block is below the model's minimum cacheable length, and so is that of every shared block
        no longer than this one (with several samples, the pair's own block carrying a breakpoint too, the same of
        every pair's text)."""
        slot = len(got)
        got.append(None)
        return self._warmed(text, usage, problems, got, slot)

    async def _warmed(
        self,
        text: prompt.PairPrompt,
        usage: TokenUsage,
        problems: list[str],
        got: list[_Sample | None],
        slot: int,
    ) -> None:
        cached: list[bool] = []
        got[slot] = await self._sample(text, usage, problems, cached)
        self._settled(text, got)
        if not cached or any(cached) or not text.cache_shared:
            return  # (an unmarked shared block: only the system prompt was asked to be cached)
        if len(text.shared) > self._shared_uncacheable_chars:
            log.info("%s cached nothing of a prompt of %d characters", self.model, len(text.text))
        self._shared_uncacheable_chars = max(self._shared_uncacheable_chars, len(text.shared))
        if self.samples > 1:
            self._pair_uncacheable_chars = max(self._pair_uncacheable_chars, len(text.text))

    def _aggregated(self, got: Sequence[_Sample | None]) -> BinForecast | None:
        valid = [s for s in got if s is not None]
        return self._aggregate(valid) if valid else None

    async def _sample(
        self,
        text: prompt.PairPrompt,
        usage: TokenUsage,
        problems: list[str],
        cached: list[bool] | None = None,
    ) -> _Sample | None:
        """One validated sample, or None (dropped) when it stays unusable after the retries. `cached` gets, per
        answered request, whether the API read or wrote any of its prompt from or to the cache."""
        from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

        max_tokens = self._max_tokens()
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(1 + self.invalid_retries),
                retry=retry_if_exception_type(prompt.InvalidAnswer),
                reraise=True,
            ):
                with attempt:
                    message, mode, max_tokens = await self._create(text, self._mode, max_tokens, usage)
                    if cached is not None:
                        tokens = getattr(message, "usage", None)
                        cached.append(
                            _tokens(tokens, "cache_read_input_tokens")
                            + _tokens(tokens, "cache_creation_input_tokens")
                            > 0
                        )
                    try:
                        sample = self._interpret(message, mode)
                    except _Truncated:
                        max_tokens = self._grown(max_tokens)
                        raise
                    self._save(_answer_key(text), sample)  # paid for: kept whatever becomes of this call
                    return sample
        except prompt.InvalidAnswer as exc:
            problems.append(f"unusable answer after {1 + self.invalid_retries} attempts: {exc}")
        except (_Dropped, _Transient) as exc:
            problems.append(str(exc))
        except ClaudeUnavailable:
            raise  # the key or model is refused: every other request would be too
        except Exception as exc:  # a response the SDK could not make sense of: this sample only
            log.warning("claude sample failed unexpectedly", exc_info=True)
            problems.append(f"unexpected {type(exc).__name__} handling the answer: {exc}")
        log.info("claude sample dropped: %s", problems[-1])
        return None

    async def _create(
        self, text: prompt.PairPrompt, mode: Literal["tool", "json"], max_tokens: int, usage: TokenUsage
    ) -> tuple[Message, Literal["tool", "json"], int]:
        """One request; returns the message, and the output mode and max_tokens it was made with (a retry of an
        answer cut off grows from the latter). Never below the mode's own max_tokens: a sample begun in tool mode
        (1024) whose mode was switched to JSON (4096, thinking counted) since is not sent with tool mode's."""
        an = self._anthropic
        message: Message
        max_tokens = max(max_tokens, self._max_tokens())
        try:
            try:
                message = await self._send(text, mode, max_tokens)
            except an.BadRequestError as exc:
                if _PROMPT_TOO_LONG in str(exc):
                    # This pair's prompt only: the other pairs of the call still get their answers.
                    raise _Dropped(f"Claude refused the request: {exc}") from exc
                if not self._switch_to_json(mode, str(exc)):
                    raise
                mode = "json"
                max_tokens = max(max_tokens, self._max_tokens())
                message = await self._send(text, mode, max_tokens)
        except an.BadRequestError as exc:
            if (hint := _ACCOUNT_REFUSALS.get(_error_code(exc) or "")) is not None:
                raise self._account_refused(exc, hint) from exc
            # Something about this request (a 400 is not billed): the call's other requests still run.
            raise _Dropped(f"Claude refused the request ({type(exc).__name__}): {exc}") from exc
        except (
            an.AuthenticationError,
            an.PermissionDeniedError,
            an.NotFoundError,
            an.PaymentRequiredError,
        ) as exc:
            # The key, the account's billing or the model: every other request would be refused too.
            raise ClaudeUnavailable(
                f"Claude request rejected ({type(exc).__name__}): {self._rejection_hint(type(exc).__name__)}; "
                f"the API said: {exc}"
            ) from exc
        except an.APIConnectionError as exc:
            raise _Transient(f"{_UNREACHABLE} ({type(exc).__name__}): {exc}") from exc
        except an.APIStatusError as exc:
            if (hint := _ACCOUNT_REFUSALS.get(_error_code(exc) or "")) is not None:
                raise self._account_refused(exc, hint) from exc
            wait = _retry_after_s(exc.response.headers)
            if wait is not None and wait > MAX_RETRY_AFTER_S:
                why = (
                    f"the Anthropic API asked to wait {wait:.0f} s before the next request "
                    f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
                )
                until = time.monotonic() + min(wait, RETRY_AFTER_PAUSE_MAX_S)
                if self._told_to_wait is None or self._told_to_wait[0] < until:
                    self._told_to_wait = (until, why)
                raise _Transient(f"Claude API error not retried: {why}") from exc
            # The SDK retries only 408, 409, 429 and 5xx (a 413, request too large, is answered at once).
            retried = self._client.max_retries > 0 and (
                exc.status_code in (408, 409, 429) or exc.status_code >= 500
            )
            when = "after retries" if retried else "not retried"
            raise _Transient(f"Claude API error {when} ({type(exc).__name__}): {exc}") from exc
        self._count(text, message, usage)
        return message, mode, max_tokens

    def _count(self, text: prompt.PairPrompt, message: Message, usage: TokenUsage) -> None:
        """An answered request: its tokens in `usage`; what it wrote to the prompt cache, until when."""
        usage.add_usage(getattr(message, "usage", None))
        until = time.monotonic() + _CACHE_TTL_S
        self._cache_warm_until = until
        key = _digest(text.shared)
        _note(self._shared_sent_until, key, until)
        if text.cache_shared:
            _note(self._shared_warm_until, key, until)

    async def _send(self, text: prompt.PairPrompt, mode: Literal["tool", "json"], max_tokens: int) -> Message:
        """One request, sent once one of the max_concurrency slots is free. Once sent, the request is billed
        whether or not its answer is read: when the caller stops waiting (the call's time limit, the engine's
        backstop, another request's refusal), it is not cancelled but finished in the background
        (_finish_late), holding its slot until it ends."""
        params = self._params(text, mode, max_tokens)
        await self._semaphore.acquire()
        try:
            request: asyncio.Task[Message] = asyncio.ensure_future(self._client.messages.create(**params))
        except BaseException:  # the SDK checks its arguments before it makes the coroutine
            self._semaphore.release()
            raise
        request.add_done_callback(lambda _: self._semaphore.release())
        try:
            return await asyncio.shield(request)
        except asyncio.CancelledError:
            task = asyncio.ensure_future(self._finish_late(request, text, mode))
            key = _answer_key(text)
            held = self._hold([key])  # its answer is appended to the pair's file
            self._late_running.setdefault(key, set()).add(task)
            task.add_done_callback(lambda t: self._late_ended(key, t, held))
            raise

    def _late_ended(self, key: str, task: asyncio.Task[None], held: list[str]) -> None:
        self._let_go(held)
        running = self._late_running.get(key)
        if running is not None:
            running.discard(task)
            if not running:
                del self._late_running[key]

    async def _finish_late(
        self, request: asyncio.Task[Message], text: prompt.PairPrompt, mode: Literal["tool", "json"]
    ) -> None:
        """A request whose caller stopped waiting, to its end (request_timeout_s at most): its usage recorded (on
        the caller's ledger), its answer kept for the pair's next call. Its call has returned: a failure is
        logged, never raised into a later call; an unusable answer is not asked again."""
        usage = TokenUsage()
        try:
            message = await asyncio.wait_for(request, self._request_timeout_s)
            self._count(text, message, usage)
            self._keep_late(_answer_key(text), self._interpret(message, mode))
        except TimeoutError:
            log.warning(
                "a Claude request still running %g s after its call's time limit was cancelled: if the API "
                "answered it, it was billed but not recorded",
                self._request_timeout_s,
            )
        except Exception as exc:
            log.warning(
                "a Claude request that ran past its call's time limit left no answer: %s: %s",
                type(exc).__name__,
                " ".join(str(exc).split())[:300],
            )
        finally:
            with anyio.CancelScope(shield=True):
                await self._record(usage, batch=False)

    def _account_refused(self, exc: Exception, hint: str) -> ClaudeUnavailable:
        return ClaudeUnavailable(
            f"Claude request rejected ({type(exc).__name__}): {hint}; the API said: {exc}"
        )

    def _rejection_hint(self, kind: str) -> str:
        """What the operator does about a refusal of every request (an SDK class name or an API error type); it
        comes first, since the answer's note keeps only the start of the message."""
        if kind in ("AuthenticationError", "authentication_error"):
            return (
                "the API key is not valid: set FORECASTER_MCP_ANTHROPIC_API_KEY (or ANTHROPIC_API_KEY) to a valid "
                "key and restart the server or rerun eval"
            )
        if kind in ("NotFoundError", "not_found_error"):
            return (
                f"no model {self.model!r} for this key: set FORECASTER_MCP_CLAUDE_MODEL to a model it can use "
                "and restart the server or rerun eval"
            )
        if kind in ("PermissionDeniedError", "permission_error"):
            return (
                f"this key may not use {self.model!r}: give its workspace access, or set "
                "FORECASTER_MCP_CLAUDE_MODEL to a model it may use"
            )
        if kind in ("PaymentRequiredError", "billing_error"):
            return "the Anthropic account is out of credit: add credit in the Anthropic Console"
        return "fix the account or model in the Anthropic Console, or unset the API key to forecast without Claude"

    def _switch_to_json(self, mode: str, error: str) -> bool:
        """A model that rejects forced tool use, or turning thinking off for it, gets JSON output instead."""
        if mode != "tool" or self._output_mode != "auto":
            return False
        if "tool_choice" not in error and "thinking" not in error:
            return False
        if self._mode == "tool":
            log.warning("%s rejects forced tool use; switching to JSON-schema output: %s", self.model, error)
            self._mode = "json"
        return True

    def _interpret(self, message: Message, mode: Literal["tool", "json"]) -> _Sample:
        """Validate one response into a sample (InvalidAnswer / _Truncated / _Dropped otherwise)."""
        if not isinstance(getattr(message, "content", None), list):
            # The SDK hands over whatever a 200 carried: a body that is not JSON arrives as a str, a JSON one
            # without content with content None. Unusable like any other unparseable answer (retried).
            raise prompt.InvalidAnswer("the response is not a Messages API answer (no content list)")
        stop = message.stop_reason
        if stop == "refusal":
            detail = message.stop_details.explanation if message.stop_details else None
            raise _Dropped(f"Claude refused to answer{': ' + detail if detail else ''}")
        if stop == "model_context_window_exceeded":
            raise _Dropped("the pair's prompt exceeds the model's context window")
        payload: object = None
        for block in message.content:
            if mode == "tool" and block.type == "tool_use" and block.name == prompt.TOOL_NAME:
                payload = block.input
            elif mode == "json" and block.type == "text":
                payload = (payload if isinstance(payload, str) else "") + block.text
        try:
            if payload is None:
                raise prompt.InvalidAnswer(f"no {'tool call' if mode == 'tool' else 'text'} in the answer")
            probs, reasoning = prompt.parse_answer(payload)
        except prompt.InvalidAnswer as exc:
            if stop == "max_tokens":
                raise _Truncated(f"answer cut off at max_tokens ({exc})") from exc
            raise
        return _Sample(probs, reasoning)

    # ------------------------------------------------------------ requests

    def _grown(self, max_tokens: int) -> int:
        """max_tokens for the retry of an answer cut off at `max_tokens`: doubled, up to 8x the first. (Past the
        model's own limit the retry is refused with a 400, which drops that sample only.)"""
        return min(2 * max_tokens, 8 * self._max_tokens())

    def _max_tokens(self) -> int:
        if self._max_tokens_override is not None:
            return self._max_tokens_override
        # JSON mode is used on models that think by default, and thinking counts against max_tokens.
        return 1024 if self._mode == "tool" else 4096

    def _params(
        self, text: prompt.PairPrompt, mode: Literal["tool", "json"], max_tokens: int
    ) -> dict[str, Any]:
        """Request body. Cache order is tools -> system -> messages, so the breakpoint on the system block
        covers the tool definition too; the second, on the shared block, covers the baseline (read by every other
        pair against it); the third (several samples) covers the pair's own text. Three of the API's four
        breakpoints. A prefix below the model's minimum cacheable length is simply not cached."""
        shared_block: dict[str, Any] = {"type": "text", "text": text.shared}
        if text.cache_shared:
            shared_block["cache_control"] = {"type": "ephemeral"}
        user_block: dict[str, Any] = {"type": "text", "text": text.own}
        if self.samples > 1:
            user_block["cache_control"] = {"type": "ephemeral"}
        params: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "system": [
                {"type": "text", "text": prompt.SYSTEM_PROMPT, "cache_control": {"type": "ephemeral"}}
            ],
            "messages": [{"role": "user", "content": [shared_block, user_block]}],
        }
        if mode == "tool":
            # Forced tool use is refused while thinking is on (the default on some models): turn it off.
            params["thinking"] = {"type": "disabled"}
            params["tools"] = [prompt.tool_definition()]
            params["tool_choice"] = {
                "type": "tool",
                "name": prompt.TOOL_NAME,
                "disable_parallel_tool_use": True,
            }
        else:
            params["output_config"] = {
                "format": {"type": "json_schema", "schema": prompt.answer_schema(strict=True)}
            }
        return params

    async def _prompts(self, queries: Sequence[PairQuery]) -> list[prompt.PairPrompt]:
        if self._features == "auto":
            self._features = prompt.default_features_fn()
        fn = self._features
        if fn is None:
            return [prompt.build_pair_prompt(q) for q in queries]
        ptxas = await self._ptxas(queries) if getattr(fn, "takes_ptxas", False) else {}

        def build(q: PairQuery) -> prompt.PairPrompt:
            baseline, rest = prompt.features_parts(fn, q, ptxas)
            return prompt.build_pair_prompt(q, rest, baseline)

        # Feature extraction may run nvcc/ptxas: keep it off the event loop.
        return list(await asyncio.gather(*(asyncio.to_thread(build, q) for q in queries)))

    async def _ptxas(self, queries: Sequence[PairQuery]) -> dict[str, object]:
        """The compiler's registers, shared memory and spills of the pairs' CUDA kernels (content key ->
        ptxas entry), when nvcc is configured and the call has at most `max_ptxas_kernels` of them (MAX_PTXAS_KERNELS
        on a server); cached on disk
        by content (the local forecaster compiles the same kernels into the same cache)."""
        if self._nvcc is None:
            return {}
        from forecaster_mcp.forecast.ptxas import ptxas_usages

        todo: dict[str, tuple[Kernel, str]] = {}
        for q in queries:
            if q.hardware is None or q.hardware.vendor != "nvidia":
                continue
            for k in (q.baseline, q.candidate):
                if k.language == "cuda":
                    todo.setdefault(k.content_key(), (k, q.hardware.arch))
        if not todo or len(todo) > self._max_ptxas_kernels:
            return {}
        usages = await ptxas_usages(todo, self._nvcc, self._cache_dir, self._ptxas_wait_s)
        entries = {key: usage.for_entry(todo[key][0].entry) for key, usage in usages.items()}
        return {key: entry for key, entry in entries.items() if entry is not None}

    # ------------------------------------------------------------ batches

    async def _run_batches(self, requests: dict[str, dict[str, Any]], outcomes: dict[str, Any]) -> str | None:
        """Submit `requests` (custom_id -> params) as one or more batches, their results into `outcomes`
        (custom_id -> result object). Returns why the batches were given up (None: every batch ended and was
        read). A batch still running after `batch_max_wait_s` is cancelled and what it had finished is read all
        the same (those answers are paid for). On an API or transport error (also one while a result stream is
        read), or when the call is cancelled (Ctrl-C), every batch not yet read is cancelled and what it had
        finished is read too, for at most _STOP_READ_WAIT_S (_stop_batches): paid for, their tokens must be
        recorded and their answers kept. `outcomes` holds what was read also when this raises."""
        import httpx2

        chunks: list[list[Any]] = [[]]
        size = 0
        for custom_id, params in requests.items():
            entry = {"custom_id": custom_id, "params": params}
            n = len(json.dumps(entry))
            if chunks[-1] and (len(chunks[-1]) >= _BATCH_MAX_REQUESTS or size + n > _BATCH_MAX_BYTES):
                chunks.append([])
                size = 0
            chunks[-1].append(entry)
            size += n
        an = self._anthropic
        created: list[str] = []
        read: set[str] = set()
        gave_up: str | None = None
        try:
            for c in chunks:
                if c:
                    created.append((await self._client.messages.batches.create(requests=c)).id)
            for batch_id in created:
                if gave_up is None:
                    gave_up = await self._wait_batch(batch_id)
                if gave_up is not None:  # this batch and the ones after it: cancel, read what they finished
                    await self._cancel_batch(batch_id)
                    if await self._ended_after_cancel(batch_id, self._batch_poll_interval_s) is None:
                        _log_unread([batch_id])
                        continue  # still not ended: its results cannot be read yet
                await self._read_results(batch_id, outcomes)
                read.add(batch_id)
        except (an.APIError, httpx2.TransportError) as exc:
            log.warning("claude batch failed; keeping the %d results read", len(outcomes), exc_info=True)
            await self._stop_batches([b for b in created if b not in read], outcomes)
            return f"Claude batch failed ({type(exc).__name__}): {exc}"
        except BaseException:
            # Cancelled (an evaluation stopped with Ctrl-C) or failed otherwise: a batch left running goes on for
            # up to 24 h and is billed in full for answers no one will read.
            await self._stop_batches([b for b in created if b not in read], outcomes)
            raise
        return gave_up

    async def _stop_batches(self, batch_ids: list[str], outcomes: dict[str, Any]) -> None:
        """Cancel the batches, then read what each had finished into `outcomes`: the API bills those requests, and
        unread their tokens go unrecorded and their answers are asked (and paid) again by a rerun. Shielded (a
        Ctrl-C stops here too) and bounded: the cancels take CANCEL_WAIT_S at most (_cancel_batches), a batch whose
        cancel was not confirmed (nor seen ended) is logged as possibly billed in full; a batch that has not ended
        (its results are readable only then), or whose results are not read, within _STOP_READ_WAIT_S is logged as
        billed but not recorded."""
        import httpx2

        if not batch_ids:
            return
        unread = list(batch_ids)
        with anyio.CancelScope(shield=True):
            unconfirmed = await self._cancel_batches(batch_ids)
            interval = min(self._batch_poll_interval_s, _STOP_READ_WAIT_S / (_CANCEL_POLLS + 1))
            with anyio.move_on_after(_STOP_READ_WAIT_S):
                for batch_id in batch_ids:
                    try:
                        ended = await self._ended_after_cancel(batch_id, interval)
                        if ended is None:
                            continue  # not ended yet: its results cannot be read
                        unconfirmed.discard(batch_id)  # ended: it bills nothing more
                        # Any request finished is billed: its results are worth reading.
                        if ended.request_counts.succeeded or ended.request_counts.errored:
                            await self._read_results(batch_id, outcomes)
                        unread.remove(batch_id)
                    except (self._anthropic.APIError, httpx2.TransportError) as exc:
                        log.warning("could not read what cancelled batch %s finished: %s", batch_id, exc)
        if unconfirmed:
            log.warning(
                "the cancel of Claude batch(es) %s was not confirmed within %g s: they may run on (up to 24 h) and "
                "be billed in full; cancel them in the Anthropic Console",
                ", ".join(b for b in batch_ids if b in unconfirmed),
                CANCEL_WAIT_S,
            )
        if unread:
            _log_unread(unread)

    async def _cancel_batches(self, batch_ids: Sequence[str]) -> set[str]:
        """Cancel the batches together, each request sent once (no SDK retries) with a CANCEL_WAIT_S timeout, all
        given up after CANCEL_WAIT_S (the transport's timeout bounds each wait on it, not a whole request); the
        batches whose cancel was not confirmed."""
        import httpx2

        canceller = self._client.with_options(max_retries=0, timeout=CANCEL_WAIT_S)
        unconfirmed = set(batch_ids)

        async def cancel(batch_id: str) -> None:
            try:
                await canceller.messages.batches.cancel(batch_id)
            except (self._anthropic.APIError, httpx2.TransportError) as exc:
                log.info("could not cancel batch %s: %s", batch_id, exc)
            else:
                unconfirmed.discard(batch_id)

        with anyio.move_on_after(CANCEL_WAIT_S):
            async with anyio.create_task_group() as tg:
                for batch_id in batch_ids:
                    tg.start_soon(cancel, batch_id)
        return unconfirmed

    async def _ended_after_cancel(self, batch_id: str, interval: float) -> Any | None:
        """A cancelled batch once it has ended (its results are then readable); None when it has not ended within
        _CANCEL_POLLS more polls `interval` apart."""
        for poll in range(_CANCEL_POLLS + 1):
            if poll:
                await self._sleep(interval)
            batch = await self._client.messages.batches.retrieve(batch_id)
            if batch.processing_status == "ended":
                return batch
        return None

    async def _wait_batch(self, batch_id: str) -> str | None:
        """Poll until the batch ends (None), or for batch_max_wait_s: then why the wait is given up (the caller
        cancels it)."""
        waited = 0.0
        status = "in_progress"
        while True:
            try:
                batch = await self._client.messages.batches.retrieve(batch_id)
                status = batch.processing_status
            except self._anthropic.APIError as exc:
                # A status check that still fails after the SDK's own retries (a 503, a connection blip) says
                # nothing of the batch, which goes on (and is billed): poll again, never cancel for it.
                if not _transient_api_error(self._anthropic, exc):
                    raise
                log.warning("claude batch %s status check failed (%s); polling again", batch_id, exc)
            else:
                if status == "ended":
                    return None
            if waited >= self._batch_max_wait_s:
                return f"Claude batch {batch_id} still {status} after {waited:.0f} s; cancelled it"
            await self._sleep(self._batch_poll_interval_s)
            waited += self._batch_poll_interval_s

    async def _read_results(self, batch_id: str, outcomes: dict[str, Any]) -> None:
        """Read an ended batch's results into `outcomes` (custom_id -> result). A line that cannot be read is an
        _Unreadable under its custom_id (when it names one; else under a key no request has) and the lines after it
        are read all the same: the SDK's decoder ended the whole read at the first such line, and every result of
        the batch, paid for, was lost. A download cut midway (a connection reset) is tried again, up to
        _RESULTS_READS times with a pause between: the results stay available and every one is paid for. The last
        failure is raised."""
        import httpx2

        for attempt in range(_RESULTS_READS):
            try:
                decoder = await self._client.messages.batches.results(batch_id)
                try:
                    # The response's lines, not the decoder's items: the decoder raises on a line it cannot
                    # parse, and its stream cannot be read on after that.
                    n = 0
                    async for line in decoder.http_response.aiter_lines():
                        if line.strip():
                            n += 1
                            custom_id, result = _result_line(line)
                            outcomes[custom_id or f"?{batch_id}:{n}"] = result
                finally:
                    await decoder.close()
                return
            except (self._anthropic.APIError, httpx2.TransportError) as exc:
                last = attempt == _RESULTS_READS - 1
                if last or not _transient_api_error(self._anthropic, exc):
                    raise
                log.warning("claude batch %s results download broke (%s); reading it again", batch_id, exc)
                await self._sleep(self._batch_poll_interval_s)

    async def _cancel_batch(self, batch_id: str) -> None:
        try:
            await self._client.messages.batches.cancel(batch_id)
        except self._anthropic.APIError as exc:
            log.warning("could not cancel batch %s: %s", batch_id, exc)

    def _batch_outcome(
        self,
        result: Any,
        mode: Literal["tool", "json"],
        max_tokens: int,
        usage: TokenUsage,
        problems: list[str],
        into: list[_Sample],
    ) -> int | None:
        """Handle one batch result: append a valid sample, or return max_tokens for a retry (None: drop)."""
        if result is None:
            problems.append("batch result missing")
            return max_tokens
        if result.type == "succeeded":
            message = result.message
            usage.add_usage(getattr(message, "usage", None))
            try:
                into.append(self._interpret(message, mode))
            except _Truncated as exc:
                problems.append(str(exc))
                return self._grown(max_tokens)
            except prompt.InvalidAnswer as exc:
                problems.append(f"unusable answer: {exc}")
                return max_tokens
            except _Dropped as exc:
                problems.append(str(exc))
            except Exception as exc:  # as in _sample: a result the SDK could not make sense of drops this one
                log.warning("claude batch result failed unexpectedly", exc_info=True)
                problems.append(f"unexpected {type(exc).__name__} handling the answer: {exc}")
            return None
        if result.type == "errored":
            error = getattr(getattr(result, "error", None), "error", None)
            if error is None or not isinstance(getattr(error, "type", None), str):
                # An error of a shape the SDK did not model: drop this request, keep the rest of the batch.
                problems.append("batch request errored (no error detail)")
                return None
            problems.append(f"batch request errored: {error.type}: {error.message}")
            if error.type in _TRANSIENT_BATCH_ERRORS or self._switch_to_json(mode, error.message):
                return self._max_tokens() if mode != self._mode else max_tokens
            if error.type == "invalid_request_error":
                return None
            raise ClaudeUnavailable(
                f"Claude batch request rejected ({error.type}): {self._rejection_hint(error.type)}; the API said: "
                f"{error.message}"
            )
        problems.append(f"batch request {result.type}")  # canceled or expired: worth one more try
        return max_tokens

    # ------------------------------------------------------------ aggregation and accounting

    def _aggregate(self, samples: list[_Sample]) -> BinForecast:
        """Mean of the sample distributions, shrunk toward uniform by the spread of their p_faster.

        Shrink weight = min(1, 2 * population std of p_faster): 0 when samples agree, 1 when they split
        evenly between sure-faster and sure-slower; at least half the share of requested samples missing.
        Uniform has p_faster 0.5, so disagreement lowers confidence in the direction as well as in the bin.
        """
        n = len(samples)
        mean = [sum(s.probs[k] for s in samples) / n for k in range(bins.N_BINS)]
        pfs = [bins.p_faster(s.probs) for s in samples]
        spread = statistics.pstdev(pfs) if n > 1 else 0.0
        # Samples that did not answer (refused, unusable) leave the spread unmeasured: one answer of three
        # is not the agreement of three. Each missing one shrinks by half its share.
        missing = max(0, self.samples - n) / max(1, self.samples)
        shrink = min(1.0, max(2.0 * spread, 0.5 * missing))
        probs = [(1.0 - shrink) * m + shrink / bins.N_BINS for m in mean]
        p_agg = bins.p_faster(probs)
        best = min(range(n), key=lambda i: abs(pfs[i] - p_agg))
        reason = " ".join(samples[best].reasoning.split())[:300] or "no reasoning given"
        rationale = f"{reason} (Claude {self.model}, {n} sample{'s' if n > 1 else ''}"
        rationale += f", p_faster {'/'.join(f'{p:.2f}' for p in pfs)})" if n > 1 else ")"
        extras: dict[str, float] = {
            "claude_samples": float(n),
            "claude_samples_requested": float(self.samples),
            "claude_p_faster_spread": spread,
            "claude_shrink": shrink,
        }
        for i, p in enumerate(pfs):
            extras[f"claude_p_faster_s{i}"] = p
        return BinForecast(probs, rationale, extras)

    def _finish(self, results: list[BinForecast | None], problems: list[str]) -> list[BinForecast]:
        failed = sum(r is None for r in results)
        if failed:
            last = problems[-1] if problems else "no detail"
            raise ClaudeUnavailable(
                f"Claude gave no usable forecast for {failed} of {len(results)} pair(s) "
                f"(last problem: {last})",
                partial=results,
            )
        return [r for r in results if r is not None]

    async def _record(self, usage: TokenUsage, *, batch: bool) -> None:
        if usage.requests == 0:
            return
        cost = cost_usd(self.model, usage, batch=batch)
        self.usage_total.add(usage)
        self.cost_usd_total += cost
        if self._usage_sink is None:
            return
        try:
            await self._usage_sink.record_llm_usage(
                ledger=USAGE_LEDGER.get() or self.ledger,
                model=self.model,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cache_read_tokens=usage.cache_read_tokens,
                cache_write_tokens=usage.cache_write_tokens,
                cost_usd=cost,
            )
        except Exception:
            # Accounting must not turn a paid, successful forecast into a failure.
            log.exception("could not record Claude usage (%d requests, $%.4f)", usage.requests, cost)


@functools.cache
def _prompt_version() -> str:
    """What every request of a pair shares besides its text: the system prompt, the tool and the answer schema."""
    parts = [prompt.SYSTEM_PROMPT, prompt.tool_definition(), prompt.answer_schema(strict=True)]
    return _digest(json.dumps(parts, sort_keys=True))[:16]


class _AnswerFiles:
    """Answered samples on disk, for later processes (a restarted server, an `eval` rerun after Ctrl-C): one file
    of JSON lines per pair and answer settings, a line per sample appended the moment it is answered (one write,
    so that processes sharing the folder do not interleave lines, and a process killed right after has it kept).
    A line holds what decides the answer (model, prompt version, output mode, the prompt's hash) and is used only
    when all of them match this forecaster's; the number of samples asked does not decide a sample (each is an
    independent draw), so a forecaster asking for more reads those kept and asks only for the rest; a line that cannot be read (cut short by a crash,
    edited) is skipped, and ended by the next append. Failures to write or read are logged once, never raised:
    the forecast goes on without."""

    def __init__(self, folder: Path, model: str, samples: int, output_mode: str) -> None:
        self.folder = folder
        self._settings = {
            "model": model,
            "prompt_version": _prompt_version(),
            "output_mode": output_mode,
        }
        self._settings_key = _digest(json.dumps(self._settings, sort_keys=True))
        self._samples = samples
        self._warned = False
        self.saved = 0
        # Samples of earlier processes (or others sharing the folder) this one used: those a pair's file held when
        # this process first looked at it (`_looked`: read or written). A process reads a pair's file before it
        # asks for the pair, so what it later reads back of its own answers (memory keeps _ANSWERS_KEPT pairs) or
        # of an earlier run's again is not counted: the count says what this run did not pay for.
        self.reused = 0
        self._looked: set[str] = set()
        self.scan_due = False  # enough written since the folder's last scan (ClaudeForecaster._bound_answers)

    def _path(self, key: str) -> Path:
        return self.folder / f"{_digest(self._settings_key + key)[:40]}.jsonl"

    def paths(self, keys: Sequence[str]) -> list[str]:
        return [str(self._path(key)) for key in keys]

    def touch(self, key: str) -> None:
        """The pair `key` used now: its file not among the least recently used (the folder's eviction)."""
        with contextlib.suppress(OSError):
            os.utime(self._path(key))

    def append(self, key: str, sample: _Sample) -> None:
        self._looked.add(key)
        line = {**self._settings, "prompt_sha256": key, "probs": sample.probs, "reasoning": sample.reasoning}
        data = (json.dumps(line) + "\n").encode()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            # O_BINARY: Windows would write "\r\n" (0 elsewhere).
            flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_BINARY", 0)
            fd = os.open(self._path(key), flags, 0o644)
            try:
                size = os.fstat(fd).st_size
                if size and _byte_at(fd, size - 1) != b"\n":
                    # A line cut short (a process killed, a disk full mid-write): ended here, so that this one
                    # does not run on from it into one unreadable line.
                    data = b"\n" + data
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            self._warn(
                f"could not keep a Claude answer in {self.folder} ({exc}): it is asked again next time"
            )
            return
        self.saved += 1
        if _ANSWER_WRITES.due(self.folder, len(data), ANSWERS_CACHE_BYTES):
            self.scan_due = True

    def read(self, key: str) -> tuple[_Sample, ...]:
        """The samples kept for the pair `key` (at most as many as asked); at the first look at `key`, they count
        as reused."""
        first = key not in self._looked
        self._looked.add(key)
        try:
            text = self._path(key).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ()
        except OSError as exc:
            self._warn(f"could not read the Claude answers kept in {self.folder} ({exc})")
            return ()
        out: list[_Sample] = []
        for line in text.splitlines():
            try:
                item = json.loads(line)
                if not isinstance(item, dict) or item.get("prompt_sha256") != key:
                    continue
                if any(item.get(k) != v for k, v in self._settings.items()):
                    continue
                prompt.parse_answer({"probabilities": item.get("probs"), "reasoning": item.get("reasoning")})
            except (ValueError, RecursionError):  # not JSON (cut short), or not an answer (InvalidAnswer)
                continue
            # As answered (parse_answer normalised them then): normalising again could move their last bits.
            reasoning = item.get("reasoning")
            out.append(
                _Sample([float(p) for p in item["probs"]], reasoning if isinstance(reasoning, str) else "")
            )
            if len(out) == self._samples:
                break
        if first:
            self.reused += len(out)
        if out:
            self.touch(key)
        return tuple(out)

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", message)


class _PathsInUse:
    """The answer files the process's calls are using (a count each), spared by the folder's eviction: checked and
    removed under `lock`, taken under it, so that a file is either spared or gone before its call reads it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._count: dict[str, int] = {}

    def hold(self, paths: list[str]) -> list[str]:
        with self.lock:
            for path in paths:
                self._count[path] = self._count.get(path, 0) + 1
        return paths

    def let_go(self, paths: Sequence[str]) -> None:
        with self.lock:
            for path in paths:
                left = self._count.get(path, 0) - 1
                if left > 0:
                    self._count[path] = left
                else:
                    self._count.pop(path, None)

    def __contains__(self, path: object) -> bool:
        return path in self._count


_ANSWERS_IN_USE = _PathsInUse()
_ANSWER_WRITES = WritesSinceScan()


@dataclass(frozen=True)
class _Unreadable:
    """A line of a batch's results that could not be read, and why."""

    why: str


_RESULT_TYPES = frozenset({"succeeded", "errored", "canceled", "expired"})
_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"([^"\\]{1,64})"')


def _result_line(line: str) -> tuple[str | None, Any]:
    """One line of a batch's results: (its custom_id, or None when it names none; the SDK's result object, or an
    _Unreadable)."""
    from anthropic.types.messages import MessageBatchIndividualResponse

    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as exc:  # cut short, garbled, nested beyond the parser
        found = _CUSTOM_ID.search(line)
        return (found.group(1) if found else None), _Unreadable(f"not JSON ({type(exc).__name__})")
    custom_id = item.get("custom_id") if isinstance(item, dict) else None
    if not isinstance(custom_id, str):
        return None, _Unreadable("no custom_id")
    result = item.get("result")
    kind = result.get("type") if isinstance(result, dict) else None
    if kind not in _RESULT_TYPES:
        return custom_id, _Unreadable(f"result type {kind!r} unknown" if kind is not None else "no result")
    return custom_id, MessageBatchIndividualResponse.construct(**item).result


def _unreadable_note(named: Sequence[str]) -> str:
    shown = "; ".join(named[:5]) + (f"; and {len(named) - 5} more" if len(named) > 5 else "")
    return f"{len(named)} batch result line(s) could not be read, their samples left unanswered ({shown})"


def _note(until_by_key: OrderedDict[str, float], key: str, until: float) -> None:
    until_by_key[key] = until
    until_by_key.move_to_end(key)
    while len(until_by_key) > _SHARED_WARM_KEPT:
        until_by_key.popitem(last=False)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _byte_at(fd: int, offset: int) -> bytes:
    """The byte of open file `fd` at `offset` (os.pread does not exist on Windows)."""
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, 1)


def _answer_key(text: prompt.PairPrompt) -> str:
    """What a pair's answers are kept under (in memory and in `_AnswerFiles`): its prompt's hash, and where ledgers
    are isolated the ledger asking, so that no ledger's forecasts or Claude spending depend on what another asked
    before it (Settings.isolate_ledgers)."""
    return _digest(text.text if text.scope is None else f"{text.scope}\x00{text.text}")


def _share_copies(keys: Sequence[str], answers: list[_L]) -> list[int]:
    """The first query of each prompt (`keys`: their `_answer_key`s), which alone is asked; every later copy of a
    prompt in the call gets its first's list of samples (`answers`, made to share it), hence its answer. A pairs file
    asking a question twice in one chunk paid for each copy's samples, two independent draws that could answer the
    one question both ways."""
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        answers[i] = answers[first.setdefault(key, i)]
    return list(first.values())


def _too_long(text: str) -> str:
    return (
        f"a pair's prompt is {prompt.utf8_size(text)} bytes, over the {prompt.MAX_PROMPT_BYTES} Claude is sent (long "
        "sources, many defines): not sent; send only the kernel and its tuning parameters"
    )


def _warm_up_wait_s(deadline: float) -> float | None:
    """How long the other requests of a call wait for a warm-up: until it answers, or half the call's time left
    (without a time limit, until it answers). A warm-up is one ordinary request, answered well within half of
    forecast_timeout_s unless the API is slow: the rest are then sent after it and read the cache as before.
    Still running at half the time left, it has taken as long as the rest have left, and waiting longer would
    leave them too little: they are sent beside it, paying uncached input for answers within the limit. Each
    warm-up in turn (the system prompt's, the baselines', a pair's own) waits half of what is left then."""
    if math.isinf(deadline):
        return None
    return max(0.0, (deadline - time.monotonic()) * _WARM_UP_SHARE)


async def _after_warm_ups(
    warm_ups: Sequence[Coroutine[Any, Any, None]],
    wait_s: float | None,
    rest: Callable[[], Sequence[Coroutine[Any, Any, None]]],
) -> None:
    """The warm-ups, then the requests `rest` builds (once the warm-ups are done: it counts what they got) beside
    any warm-up still running after `wait_s`. A warm-up left running is not cancelled (it is paid for, and its
    answer is one of its pair's samples): it is awaited with the rest, and no longer waited for with them at the
    call's time limit (a request already sent then finishes in the background, _send). The first exception (the
    key refused) stops the rest, as _gather_or_cancel."""
    tasks = [asyncio.ensure_future(c) for c in warm_ups]
    try:
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done():
                task.result()  # its error stops the call before the rest is sent, as before
    except BaseException:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        raise
    await _gather_or_cancel([*(t for t in tasks if not t.done()), *rest()])


def _log_unread(batch_ids: Sequence[str]) -> None:
    log.warning(
        "cancelled Claude batch(es) %s not read: the requests they finished are billed but not recorded, and "
        "their answers not kept (a rerun asks, and pays for, them again)",
        ", ".join(batch_ids),
    )


async def _gather_or_cancel(coros: Sequence[Awaitable[_T]]) -> list[_T]:
    """gather(), but the first exception cancels the siblings: no request is sent after it (those already sent
    finish in the background, _send)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


__all__ = [
    "BATCH_DISCOUNT",
    "PRICES",
    "ClaudeForecaster",
    "ClaudeUnavailable",
    "ModelPrice",
    "RealApiCallForbidden",
    "TokenUsage",
    "UsageSink",
    "cost_usd",
    "price_for",
]
