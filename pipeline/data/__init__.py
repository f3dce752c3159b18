"""Domain data: sources, chat formatting, and the generate stage (`run`)."""

from pipeline.data.generate import run

__all__ = ["run"]
