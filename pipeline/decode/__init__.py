"""Our own lossless speculative decoder: plain decoding, chains from n-grams, draft models and
heads, and token trees, greedy and sampling; and its fast path (fast.py: static caches, fixed
shapes, CUDA graphs) for plain decoding and every chain. Module
order (each imports only those before it, and pipeline/kernels): types, kv, static_kv,
sampling, chain, ngram / draft_model / medusa / eagle, prepare, decoder, fast, tree."""

from pipeline.decode.decoder import plain_decode, speculative_decode
from pipeline.decode.draft_model import ModelDrafter
from pipeline.decode.eagle import EagleDrafter
from pipeline.decode.medusa import MedusaDrafter
from pipeline.decode.ngram import NgramDrafter
from pipeline.decode.tree import tree_decode
from pipeline.decode.types import DecodeResult, Drafter

__all__ = ["DecodeResult", "Drafter", "EagleDrafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "plain_decode",
           "speculative_decode", "tree_decode"]
