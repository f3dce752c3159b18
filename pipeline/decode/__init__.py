"""Our own lossless speculative decoder: plain decoding, chains from n-grams, draft models and
heads, and token trees, greedy and sampling, over static KV caches at fixed shapes (every
forward a CUDA graph replay on CUDA; the same code without graphs on a CPU). Module order
(each imports only those before it, and pipeline/kernels): types, static_kv, sampling, chain,
ngram / draft_model / medusa / eagle, prepare, decoder, tree."""

from pipeline.decode.decoder import continuous_decode, plain_decode, speculative_decode
from pipeline.decode.draft_model import ModelDrafter
from pipeline.decode.eagle import EagleDrafter
from pipeline.decode.medusa import MedusaDrafter
from pipeline.decode.ngram import NgramDrafter
from pipeline.decode.static_kv import StaticModel
from pipeline.decode.tree import tree_decode
from pipeline.decode.types import DecodeResult, Drafter

__all__ = ["DecodeResult", "Drafter", "EagleDrafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "StaticModel",
           "continuous_decode", "plain_decode", "speculative_decode", "tree_decode"]
