"""Self-speculation: Medusa heads, an EAGLE head and early exit on the target's own hidden states."""

from pipeline.heads.models import build_heads, load_heads, save_heads

__all__ = ["build_heads", "load_heads", "save_heads"]
