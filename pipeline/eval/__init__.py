"""Acceptance and speed measurement, reports and plots: the eval stage (`run`)."""

from pipeline.eval.stage import run

__all__ = ["run"]
