"""One exception tree for the whole package.

Every error an agent could have avoided derives from `AgentError`; the MCP layer turns those into
`ToolError` with the message unchanged, so messages are written for the agent's next move.
Anything else is an internal error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def validation_message(error: Mapping[str, Any]) -> str:
    """One pydantic error's message (an entry of `ValidationError.errors()`) without the "Value error, "
    pydantic puts before a validator's own text: noise on every line an agent or an operator reads."""
    return str(error["msg"]).removeprefix("Value error, ")


class ForecasterMcpError(Exception):
    """Base of every error this package raises on purpose."""


class AgentError(ForecasterMcpError):
    """A request the caller can fix: the message says what was wrong and what to do next."""


class InvalidRequest(AgentError):
    """Bad ids, sizes, dtypes, launch dimensions and the like."""


class UnknownLedger(AgentError):
    """The ledger named by settings, token or CLI does not exist."""


class BudgetExhausted(AgentError):
    """The ledger cannot cover the reservation a measurement needs."""

    def __init__(
        self, message: str, left_gpu_seconds: float | None = None, needed_gpu_seconds: float | None = None
    ) -> None:
        super().__init__(message)
        # What the ledger had left (limit less spent and held) and what the refused hold needed, where known:
        # with something left, a cheaper measurement may still fit (measure_if_unsure goes on to it).
        self.left_gpu_seconds = left_gpu_seconds
        self.needed_gpu_seconds = needed_gpu_seconds


# Every BudgetExhausted message holds this phrase: an MCP client sees only the text of a refused call, and the
# project's own clients (demo, search) tell a spent budget from other refusals by it.
BUDGET_EXHAUSTED_TEXT = "GPU-seconds left"


class NotMeasurable(AgentError):
    """No measurer can run this kernel here (not in any recording, no such device, no backend)."""


class ServerBusy(AgentError):
    """The server's shared capacity (its compile slots) stayed taken by other calls for the whole wait: nothing ran
    and nothing was charged; a retry may find room."""


class MeasurementInProgress(AgentError):
    """A measurement with the same idempotency key is still running."""


class ResultNotSaved(AgentError):
    """A measurement ran and was charged, but the server could not store its result (disk full, database
    locked): not the caller's doing, but the caller must know it was charged and that a retry measures again."""

    def __init__(self, message: str, charged_gpu_seconds: float = 0.0) -> None:
        super().__init__(message)
        self.charged_gpu_seconds = charged_gpu_seconds  # what the lost measurement was charged


class SameMeasurementRunning(ForecasterMcpError):
    """Internal: another hold (possibly of another process) pays for this very measurement (its cache key)."""


class OperatorError(ForecasterMcpError):
    """A CLI (operator) command failed in a way the operator can fix."""


class WorkerCrashed(ForecasterMcpError):
    """A measurement worker process died; the supervisor starts a fresh one."""


class AlreadyMeasured(ForecasterMcpError):
    """Internal: a measurement under this idempotency key was saved (possibly by another process)."""
