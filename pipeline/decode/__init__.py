"""Our own lossless speculative decoder: plain decoding, chain drafts from n-grams, draft models and heads, greedy and sampling."""

from pipeline.decode.decoder import DecodeResult, plain_decode, speculative_decode
from pipeline.decode.drafters import Drafter, EagleDrafter, MedusaDrafter, ModelDrafter, NgramDrafter

__all__ = ["DecodeResult", "Drafter", "EagleDrafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "plain_decode", "speculative_decode"]
