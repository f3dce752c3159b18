"""Our own lossless speculative decoder: plain decoding, chain drafts, greedy and sampling."""

from pipeline.decode.decoder import DecodeResult, plain_decode, speculative_decode
from pipeline.decode.drafters import Drafter, ModelDrafter, NgramDrafter

__all__ = ["DecodeResult", "Drafter", "ModelDrafter", "NgramDrafter", "plain_decode", "speculative_decode"]
