"""The draft kinds: one table of how each is found in a run, loaded, drafted with and exported.

    kind         trained by   a bundle holds             trees  int8 on CPU
    ngram        -            nothing (settings only)    -      -
    draft_model  distill      draft/  (HF folder)        -      yes
    medusa       heads        heads/  + medusa/          yes    yes
    eagle        heads        heads/  + eagle3/, speculators/  yes  - (its features feed back)
    early_exit   heads        heads/                     -      - (mostly the target's layers)

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
    """Replay the draft's forwards from captured CUDA graphs (eval.cuda_graphs, on one CUDA device)."""
    fixed_shapes: Optional[bool] = None
    """Draft at the same shapes every step (default: with graphs; see decode.static_kv.StaticModel)."""


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
    """Its drafter also proposes token trees (propose_tree; eval's `<name>_tree`)."""
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


def _draft_model(module, target, o: DraftOptions, name: str = "draft_model"):
    from pipeline.decode import ModelDrafter

    return ModelDrafter(module, o.temperature, o.top_p, o.generator, name=name,
                        confidence_threshold=o.confidence_threshold, graphs=o.graphs, fixed_shapes=o.fixed_shapes)


def _medusa(module, target, o: DraftOptions):
    from pipeline.decode import MedusaDrafter

    return MedusaDrafter(module, target.config.vocab_size, o.temperature, o.top_p, o.generator,
                         choices=o.medusa_choices)


def _eagle(module, target, o: DraftOptions):
    from pipeline.decode import EagleDrafter

    return EagleDrafter(module, target.config.vocab_size, o.temperature, o.top_p, o.generator,
                        confidence_threshold=o.confidence_threshold, graphs=o.graphs, tree_depth=o.tree_depth,
                        tree_topk=o.tree_topk, fixed_shapes=o.fixed_shapes)


def _early_exit(module, target, o: DraftOptions):
    from pipeline.heads.models import early_exit_model

    # The target's first layers and an adapter: a draft model sharing the target's weights.
    return _draft_model(early_exit_model(target, module), target, o, name="early_exit")


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
    "ngram": Kind("ngram", None, _ngram, describe="prompt lookup (n-gram) drafting, no weights"),
    "draft_model": Kind("draft_model", "distill", _draft_model, load=_load_draft, weights="checkpoint",
                        bundle_folder="draft", int8=True, stops_early=True, describe="draft model"),
    "medusa": Kind("medusa", "heads", _medusa, load=_load_heads, bundle_folder="heads", trees=True, int8=True,
                   describe="Medusa heads on the target's own hidden states",
                   settings=("medusa_num_heads", "medusa_num_layers"), formats=_medusa_formats),
    "eagle": Kind("eagle", "heads", _eagle, load=_load_heads, bundle_folder="heads", trees=True, stops_early=True,
                  describe="EAGLE head on the target's own hidden states", settings=("feature_layers", "ttt_steps"),
                  formats=_eagle_formats),
    "early_exit": Kind("early_exit", "heads", _early_exit, load=_load_heads, bundle_folder="heads", stops_early=True,
                       describe="early-exit adapter on the target's own hidden states",
                       settings=("exit_layer", "adapter_rank")),
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
