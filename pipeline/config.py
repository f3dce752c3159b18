"""Typed schemas for every config group, registered in Hydra's ConfigStore.

YAML files in `conf/<group>/` extend these schemas, so a mistyped key or a value of the
wrong type fails when the config is composed, before any work starts. Validation that
needs more than a type lives in `__post_init__`, which runs when `to_config` turns the
composed config into these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

DTYPES = ("auto", "float32", "bfloat16", "float16")
DATA_SOURCES = ("sharegpt", "mtbench", "file")
SPLITS = ("train", "eval", "all")
LOGGERS = ("none", "wandb")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")


def _check_positive(name: str, value: Optional[float]) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass
class TargetConfig:
    """The model that drafts are matched to."""

    name_or_path: str = MISSING
    """An embedded target name (`smollm2_135m`), a Hugging Face model id, or a local folder."""
    gguf_file: Optional[str] = None
    """A GGUF file inside `name_or_path`; converted once to safetensors in the cache."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) for a model id."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    """auto (the process's CUDA device when there is one, else cpu), cpu, cuda, cuda:N."""
    trust_remote_code: bool = False
    """Run modeling code shipped with a hub model. Off unless you trust its author."""
    cache_dir: Optional[str] = None
    """Converted targets and fingerprints; default $SPECDRAFT_CACHE or ~/.cache/specdraft."""

    def __post_init__(self) -> None:
        _check_choice("target.dtype", self.dtype, DTYPES)


@dataclass
class DataConfig:
    """Domain data: where conversations come from and which of them to use."""

    source: str = MISSING
    """sharegpt (embedded ShareGPT V3), mtbench (80 MT-bench questions) or file."""
    path: Optional[str] = None
    """With source=file: a .jsonl, .json or .parquet file of chat, ShareGPT or prompt records."""
    split: str = "all"
    """train, eval or all: a deterministic split by record id."""
    eval_fraction: float = 0.05
    """Share of records that fall in the eval split."""
    limit: Optional[int] = None
    """Use at most this many conversations (after skipping bad records)."""
    max_prompt_tokens: int = 1024
    """A record whose first prompt is longer than this is skipped and counted as too long."""
    max_turns: Optional[int] = None
    """Regenerate at most this many user turns per conversation."""

    def __post_init__(self) -> None:
        _check_choice("data.source", self.source, DATA_SOURCES)
        _check_choice("data.split", self.split, SPLITS)
        if self.source == "file" and not self.path:
            raise ValueError("data.source=file needs data.path=<a .jsonl, .json or .parquet file>")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        _check_positive("data.limit", self.limit)
        _check_positive("data.max_prompt_tokens", self.max_prompt_tokens)
        _check_positive("data.max_turns", self.max_turns)


@dataclass
class GenerateConfig:
    """The generate stage: the target regenerates every assistant turn."""

    max_new_tokens: int = 256
    """Longest answer per turn."""
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    batch_size: int = 16
    """Sequences per forward pass; prompts are sorted by length so padding stays small."""
    shard_size: int = 64
    """Conversations per shard; each shard is written atomically and never redone."""
    max_length: int = 2048
    """A turn is generated only if its context plus max_new_tokens fits in this many tokens."""
    save_topk_logits: int = 0
    """If > 0, also store the target's top-k logits (fp16) at every generated position."""
    overwrite: bool = False
    """Start over when the run folder holds a generate stage with a different config."""

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "shard_size", "max_length"):
            _check_positive(f"generate.{name}", getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"generate.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"generate.top_p must be in (0, 1], got {self.top_p}")
        if self.save_topk_logits < 0:
            raise ValueError(f"generate.save_topk_logits must be >= 0, got {self.save_topk_logits}")


@dataclass
class EvalConfig:
    """The eval stage: acceptance and speed of every drafter against plain decoding."""

    max_new_tokens: int = 256
    """Longest answer per turn."""
    temperature: float = 0.0
    """0 is greedy (outputs are then checked token for token against plain decoding)."""
    top_p: float = 1.0
    num_draft_tokens: str = "auto"
    """auto (the sweep value with the highest measured tokens/s) or a fixed number."""
    sweep: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6])
    """num_draft_tokens values measured for each drafter (with num_draft_tokens=auto)."""
    sweep_prompts: int = 3
    """Conversations (every turn) the sweep runs on; the chosen value then runs on all of them."""
    batch_size: int = 1
    """Prompts decoded together (speed is reported per batch size; 1 is the standard)."""
    draft: Optional[str] = None
    """Another draft model folder (save_pretrained, same vocabulary) to measure as draft_model."""
    ngram: bool = True
    """Measure prompt-lookup (ngram) drafting."""
    ngram_max: int = 3
    ngram_min: int = 2
    """Prompt lookup matches the last ngram_max..ngram_min tokens."""
    compare_hf: bool = False
    """Also run HF assisted generation and prompt lookup with the same drafts and num_draft_tokens."""

    def __post_init__(self) -> None:
        if self.num_draft_tokens != "auto" and not (str(self.num_draft_tokens).isdigit() and int(self.num_draft_tokens) > 0):
            raise ValueError(f"eval.num_draft_tokens must be auto or a positive integer, got {self.num_draft_tokens!r}")
        for name in ("max_new_tokens", "sweep_prompts", "batch_size", "ngram_max", "ngram_min"):
            _check_positive(f"eval.{name}", getattr(self, name))
        if not self.sweep or min(self.sweep) < 1:
            raise ValueError(f"eval.sweep needs positive values, got {self.sweep}")
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("eval.temperature must be >= 0 and eval.top_p in (0, 1]")
        if self.ngram_min > self.ngram_max:
            raise ValueError("eval.ngram_min must be <= eval.ngram_max")

    @property
    def fixed_num_draft_tokens(self) -> Optional[int]:
        return None if self.num_draft_tokens == "auto" else int(self.num_draft_tokens)


@dataclass
class LoggerConfig:
    """Where stages log their metrics."""

    kind: str = "none"
    """none or wandb."""
    project: str = "specdraft"
    entity: Optional[str] = None
    mode: str = "offline"
    """wandb mode: offline (default, needs no network), online or disabled."""

    def __post_init__(self) -> None:
        _check_choice("logger.kind", self.kind, LOGGERS)


@dataclass
class Config:
    stage: str = MISSING
    """The stage to run; set by choosing a `conf/stage/<name>.yaml` (stage=<name>)."""
    run: str = "default"
    """Run name: every stage reads and writes `<runs_dir>/<run>/`."""
    runs_dir: str = "runs"
    seed: int = 0
    target: TargetConfig = MISSING
    data: DataConfig = MISSING
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = MISSING


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="target", name="base_target", node=TargetConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="logger", name="base_logger", node=LoggerConfig)


def to_config(cfg: DictConfig) -> Config:
    """The composed Hydra config as validated dataclasses (runs every `__post_init__`)."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]
