"""specdraft: train and measure speculative-decoding drafts matched to one target."""

__version__ = "0.1.0"
