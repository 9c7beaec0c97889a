"""forecaster-mcp: ask a forecaster first, spend GPU budget only when it is unsure."""

__version__ = "0.1.0"
