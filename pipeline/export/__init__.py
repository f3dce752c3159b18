"""The export stage: the matched draft-target bundle (bundle.py) and its writer (stage.py)."""

from pipeline.export.bundle import Bundle, load_bundle
from pipeline.export.stage import run

__all__ = ["Bundle", "load_bundle", "run"]
