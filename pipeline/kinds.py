"""The draft kinds: one table of how each is found in a run, loaded, drafted with and exported.

    kind         trained by   a bundle holds             trees  int8 on CPU  fast path (CUDA)
    ngram        -            nothing (settings only)    -      -            yes
    draft_model  distill      draft/  (HF folder)        -      yes          yes
    medusa       heads        heads/  + medusa/          yes    yes          yes (and trees)
    eagle        heads        heads/  + eagle3/, speculators/  yes  - (its features feed back)  yes (and trees)
    early_exit   heads        heads/                     -      - (mostly the target's layers)  yes

Adding a kind touches this table and one drafter module in pipeline/decode/. The names come
from pipeline.config (METHODS), which validates what users choose; a test checks they agree.
Imports of what a kind needs happen inside its functions, so this module stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline.config import METHODS
from pipeline.runs import stage_dir


@dataclass(frozen=True)
class DraftOptions:
    """How drafters draw and shape their proposals (the decoder's and eval's settings)."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: Any = None
    ngram_max: int = 3
    ngram_min: int = 2
    tree_depth: int = 5
    tree_topk: int = 4
    medusa_choices: Optional[list] = None
    confidence_threshold: float = 0.0
    graphs: bool = False
    """On the fast path (pipeline/decode/fast.py): replay the draft's forwards from CUDA graphs."""


@dataclass(frozen=True)
class NgramSettings:
    """What an ngram bundle holds instead of weights: the n-gram lengths prompt lookup matches."""

    ngram_max: int
    ngram_min: int


@dataclass(frozen=True)
class Kind:
    name: str
    trained_by: Optional[str]
    """The stage that trains it (distill or heads); None: it needs no training (ngram)."""
    drafter: Callable[[Any, Any, DraftOptions], Any]
    """(draft module, or an ngram bundle's NgramSettings, or None; target model; options) -> the
    decoder's Drafter."""
    load: Optional[Callable[[Path, Any], Any]] = None
    """(weights folder, Target) -> the draft module (safetensors only)."""
    weights: str = ""
    """Where the weights are inside its trained stage folder ("" : the folder itself)."""
    bundle_folder: Optional[str] = None
    """Where a bundle keeps them."""
    trees: bool = False
    """Also decoded as a token tree (eval's `<name>_tree`)."""
    int8: bool = False
    """eval.draft_int8 runs its own linear layers in int8 on CPU."""
    stops_early: bool = False
    """Its chain ends at a token the draft is unsure of (eval.confidence_threshold)."""
    describe: str = ""
    settings: tuple[str, ...] = ()
    """The training config keys (heads.*) a bundle records."""
    formats: Optional[Callable[..., dict]] = None
    """(draft module, Target, base model name, num_draft_tokens, bundle folder) -> {format: subfolder}
    for the engine layouts it writes besides our own."""
    fast: Optional[Callable[[Any, Any, DraftOptions], Any]] = None
    """Like `drafter`, for the fast path's chains (static caches, fixed shapes); None: the kind
    decodes on the CPU path's decoder even where the fast path is on."""
    fast_trees: bool = False
    """Its fast drafter also proposes token trees on the fast path."""

    def trained_folder(self, runs_dir: str | Path, run: str) -> Path:
        if self.trained_by == "distill":
            return stage_dir(runs_dir, run, "distill")
        return stage_dir(runs_dir, run, "heads") / self.name

    def train_command(self, run: str) -> str:
        extra = f" heads={self.name}" if self.trained_by == "heads" else ""
        return f"python -m pipeline stage={self.trained_by}{extra} run={run}"


def _ngram(settings: Optional[NgramSettings], target, o: DraftOptions):
    from pipeline.decode import NgramDrafter

    lengths = (settings.ngram_max, settings.ngram_min) if settings is not None else (o.ngram_max, o.ngram_min)
    return NgramDrafter(*lengths, o.temperature, target.config.vocab_size)


def _draft_model(module, target, o: DraftOptions):
    from pipeline.decode import ModelDrafter

    return ModelDrafter(module, o.temperature, o.top_p, o.generator, confidence_threshold=o.confidence_threshold)


def _fast_ngram(settings: Optional[NgramSettings], target, o: DraftOptions):
    from pipeline.decode.ngram import FastNgramDrafter

    lengths = (settings.ngram_max, settings.ngram_min) if settings is not None else (o.ngram_max, o.ngram_min)
    return FastNgramDrafter(*lengths, o.temperature, target.config.vocab_size)


def _fast_draft_model(module, target, o: DraftOptions):
    from pipeline.decode.draft_model import FastModelDrafter

    return FastModelDrafter(module, o.temperature, o.top_p, o.generator,
                            confidence_threshold=o.confidence_threshold, graphs=o.graphs)


def _fast_medusa(module, target, o: DraftOptions):
    from pipeline.decode.medusa import FastMedusaDrafter

    return FastMedusaDrafter(_medusa(module, target, o))


def _fast_eagle(module, target, o: DraftOptions):
    from pipeline.decode.eagle import FastEagleDrafter

    return FastEagleDrafter(module, target.config.vocab_size, o.temperature, o.top_p, o.generator,
                            confidence_threshold=o.confidence_threshold, graphs=o.graphs, tree_depth=o.tree_depth,
                            tree_topk=o.tree_topk)


def _fast_early_exit(module, target, o: DraftOptions):
    from pipeline.decode.draft_model import FastModelDrafter
    from pipeline.decode.static_kv import use_static_attention
    from pipeline.heads.models import early_exit_model

    draft = early_exit_model(target, module)  # shares the target's first layers (and their attention setting)
    use_static_attention(draft)
    return FastModelDrafter(draft, o.temperature, o.top_p, o.generator, name="early_exit",
                            confidence_threshold=o.confidence_threshold, graphs=o.graphs)


def _medusa(module, target, o: DraftOptions):
    from pipeline.decode import MedusaDrafter

    return MedusaDrafter(module, target.config.vocab_size, o.temperature, o.top_p, o.generator,
                         choices=o.medusa_choices)


def _eagle(module, target, o: DraftOptions):
    from pipeline.decode import EagleDrafter

    return EagleDrafter(module, target.config.vocab_size, o.temperature, o.top_p, o.generator,
                        tree_depth=o.tree_depth, tree_topk=o.tree_topk, confidence_threshold=o.confidence_threshold)


def _early_exit(module, target, o: DraftOptions):
    from pipeline.decode import ModelDrafter
    from pipeline.heads.models import early_exit_model

    return ModelDrafter(early_exit_model(target, module), o.temperature, o.top_p, o.generator, name="early_exit",
                        confidence_threshold=o.confidence_threshold)


def _load_draft(folder: Path, target):
    from pipeline.distill.draft import load_draft

    return load_draft(folder, target)


def _load_heads(folder: Path, target):
    from pipeline.heads.models import load_heads

    return load_heads(folder, target.model)


def _medusa_formats(heads, target, base: str, num_draft_tokens: int, folder: Path) -> dict:
    from pipeline.heads.formats import MEDUSA_DIR, write_medusa

    write_medusa(heads, target.model, base, folder / MEDUSA_DIR)
    return {"medusa": MEDUSA_DIR}


def _eagle_formats(head, target, base: str, num_draft_tokens: int, folder: Path) -> dict:
    from pipeline.heads.formats import EAGLE3_DIR, SPECULATORS_DIR, write_eagle3, write_speculators

    write_eagle3(head, target.model, folder / EAGLE3_DIR)
    write_speculators(head, target.model, base, num_draft_tokens, folder / SPECULATORS_DIR)
    return {"eagle3": EAGLE3_DIR, "speculators": SPECULATORS_DIR}


KINDS: dict[str, Kind] = {
    "ngram": Kind("ngram", None, _ngram, describe="prompt lookup (n-gram) drafting, no weights", fast=_fast_ngram),
    "draft_model": Kind("draft_model", "distill", _draft_model, load=_load_draft, weights="checkpoint",
                        bundle_folder="draft", int8=True, stops_early=True, describe="draft model",
                        fast=_fast_draft_model),
    "medusa": Kind("medusa", "heads", _medusa, load=_load_heads, bundle_folder="heads", trees=True, int8=True,
                   describe="Medusa heads on the target's own hidden states",
                   settings=("medusa_num_heads", "medusa_num_layers"), formats=_medusa_formats, fast=_fast_medusa,
                   fast_trees=True),
    "eagle": Kind("eagle", "heads", _eagle, load=_load_heads, bundle_folder="heads", trees=True, stops_early=True,
                  describe="EAGLE head on the target's own hidden states", settings=("feature_layers", "ttt_steps"),
                  formats=_eagle_formats, fast=_fast_eagle, fast_trees=True),
    "early_exit": Kind("early_exit", "heads", _early_exit, load=_load_heads, bundle_folder="heads", stops_early=True,
                       describe="early-exit adapter on the target's own hidden states",
                       settings=("exit_layer", "adapter_rank"), fast=_fast_early_exit),
}
assert tuple(KINDS) == METHODS, "pipeline.config.METHODS and the registry list the same kinds"
HEAD_KINDS = tuple(name for name, kind in KINDS.items() if kind.trained_by == "heads")
TREE_SUFFIX = "_tree"


def kind_of_method(method: str) -> tuple[Kind, bool]:
    """The kind of an eval method name (`eagle`, `eagle_tree`, `draft_model:fp32`, ...) and
    whether it decodes a tree."""
    base = method.split(":", 1)[0]
    tree = base.endswith(TREE_SUFFIX)
    return KINDS[base.removesuffix(TREE_SUFFIX)], tree


def make_drafter(kind: str, module, target, **options) -> Any:
    """The decoder's drafter for a draft of `kind` (module: its weights; None for ngram)."""
    return KINDS[kind].drafter(module, target, DraftOptions(**options))
