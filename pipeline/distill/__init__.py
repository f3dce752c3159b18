"""The distill stage: a small separate draft model distilled to the target."""

from pipeline.distill.stage import run

__all__ = ["run"]
