"""Typed schemas for every config group, registered in Hydra's ConfigStore.

YAML files in `conf/<group>/` extend these schemas, so a mistyped key or a value of the
wrong type fails when the config is composed, before any work starts. Validation that
needs more than a type lives in `__post_init__`, which runs when `to_config` turns the
composed config into these dataclasses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from pipeline.errors import PipelineError

DTYPES = ("auto", "float32", "bfloat16", "float16")
METHODS = ("ngram", "draft_model", "medusa", "eagle", "early_exit")
"""The draft kinds (pipeline/kinds.py holds what each does); the last three are heads."""
HEAD_KINDS = METHODS[2:]
DATA_SOURCES = ("sharegpt", "mtbench", "file")
SPLITS = ("train", "eval", "all")
GRAPH_CHOICES = ("auto", "on", "off")
GENERATE_BACKENDS = ("local", "server")
TIMING_NOISE = 0.03
"""Relative speed differences below this are within timing noise on a busy machine: eval
treats num_draft_tokens values predicted this close as equal, export does not call a method
this close to plain decoding faster."""
LOGGERS = ("none", "wandb")


RUN_NAME = re.compile(r"[A-Za-z0-9_.-]+")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?")


def check_run_name(run: str) -> None:
    """`run=` names one folder inside runs_dir: never a path that leads elsewhere."""
    if not RUN_NAME.fullmatch(run) or run in (".", ".."):
        raise ValueError(f"run={run!r} is not a run name: use letters, digits and -_. only "
                         "(runs_dir=<folder> says where runs go)")


def _check_finite(node: str, obj) -> None:
    """NaN and infinity pass every comparison check silently; no setting means them."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{node}.{f.name} must be a finite number, got {value}")


def use_graphs(setting: str, device_type: str, split: bool, stage: str) -> bool:
    """Whether our decoder replays its forwards from captured CUDA graphs, for a `cuda_graphs`
    setting (auto: on one CUDA device; on; off) and a target on this device type, split across
    devices or not."""
    if setting == "on" and (device_type != "cuda" or split):
        where = "split across devices" if split else f"on {device_type}"
        raise PipelineError(f"{stage}.cuda_graphs=on needs the target on one CUDA device; it is {where} "
                         f"(auto turns graphs on where they run)")
    return setting == "on" or (setting == "auto" and device_type == "cuda" and not split)


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
    device_map: Optional[str] = None
    """auto: split a target larger than one device over every GPU (then CPU memory, then disk)
    with accelerate's big-model loading, in place of target.device; null: one device."""
    max_memory: Optional[Any] = None
    """With device_map=auto, the most each device may hold, e.g. {0: 70GiB, 1: 70GiB, cpu: 200GiB}
    (GPU index or cpu -> size; typed Any: OmegaConf cannot merge a typed dict with int keys)."""

    def __post_init__(self) -> None:
        _check_choice("target.dtype", self.dtype, DTYPES)
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"target.device={self.device!r} is not a device: auto, cpu, cuda or cuda:N")
        if self.device_map not in (None, "auto"):
            raise ValueError(f"target.device_map={self.device_map!r} is not auto or null")
        if self.max_memory is not None:
            if self.device_map is None:
                raise ValueError("target.max_memory needs target.device_map=auto")
            if not isinstance(self.max_memory, dict) or not all(
                    isinstance(k, int) or k in ("cpu", "disk", "mps") for k in self.max_memory):
                raise ValueError(f"target.max_memory={self.max_memory!r} is not a map of devices to sizes, "
                                 "e.g. {0:70GiB,1:70GiB,cpu:200GiB}")


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
    per_category: Optional[int] = None
    """Use at most this many conversations of each category (MT-bench's 8; a source without
    categories is one), the first in file order: a subset that spans every category, where
    `limit` alone takes the first categories only."""
    max_prompt_tokens: int = 1024
    """A record whose first prompt is longer than this is skipped and counted as too long."""
    max_turns: Optional[int] = None
    """Regenerate at most this many user turns per conversation."""

    def __post_init__(self) -> None:
        _check_finite("data", self)
        _check_choice("data.source", self.source, DATA_SOURCES)
        _check_choice("data.split", self.split, SPLITS)
        if self.source == "file" and not self.path:
            raise ValueError("data.source=file needs data.path=<a .jsonl, .json or .parquet file>")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        _check_positive("data.limit", self.limit)
        _check_positive("data.per_category", self.per_category)
        _check_positive("data.max_prompt_tokens", self.max_prompt_tokens)
        _check_positive("data.max_turns", self.max_turns)


@dataclass
class ServerConfig:
    """generate.backend=server: the OpenAI-compatible endpoints (vLLM, SGLang, llama.cpp) that
    serve the target."""

    urls: list[str] = field(default_factory=list)
    """Base URLs ending in /v1, e.g. [http://node1:8000/v1, http://node2:8000/v1]; conversations
    are spread over them. Not part of the plan: a restarted server may move."""
    model: Optional[str] = None
    """The served model id; null: the first one the first URL lists at /models."""
    concurrency: int = 64
    """Conversations in flight at once, over all URLs (each sends its turns in order)."""
    timeout_s: float = 600.0
    """Longest wait for one answer, from the request's start to the answer's last byte."""
    retries: int = 3
    """A failed request (connection error, timeout, 5xx, 429) is tried again this many times,
    on the next URL, after backoff_s, 2 * backoff_s, ...; a conversation still failing is
    skipped and counted (skipped_records.server_failed; a malformed answer, not retried:
    malformed_answer); generate.retry_failed=true asks for them again."""
    backoff_s: float = 1.0
    prompt: str = "auto"
    """How prompts go to the server: ids (token ids: vLLM, SGLang, llama.cpp's C++ server take
    them, and nothing is tokenized twice), text (the rendering's text: llama-cpp-python), or
    auto: ids where the first URL takes them, else text."""
    api_key_env: Optional[str] = None
    """The environment variable that holds the API key (sent as a bearer token); the key itself
    never goes in a config, the manifest or a log."""

    def __post_init__(self) -> None:
        _check_finite("generate.server", self)
        for name in ("concurrency", "timeout_s"):
            _check_positive(f"generate.server.{name}", getattr(self, name))
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError("generate.server.retries and backoff_s must be >= 0")
        _check_choice("generate.server.prompt", self.prompt, ("auto", "ids", "text"))
        for url in self.urls:
            if not re.fullmatch(r"https?://[^/\s@]+(/\S*)?", url):  # no user:password@ (it would be logged)
                shown = re.sub(r"^([a-z]+://)?[^/]*@", r"\1***@", url)  # nor in this message
                raise ValueError(f"generate.server.urls: {shown!r} is not an http(s) URL like http://host:8000/v1 "
                                 "(a key goes in generate.server.api_key_env)")


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
    target_answers: float = 1.0
    """Share of conversations (a fixed hash of the id) whose answers the target regenerates. The
    others keep the source's own answers (cut to max_new_tokens), which the target only scores
    with one teacher-forced pass, many times cheaper per token than decoding, so a distill run
    gets far more text; the draft learns the target's distribution on it through the stored
    top-k logits (save_topk_logits) or the online teacher. Conversations without answers in the
    source are always regenerated."""
    overwrite: bool = False
    """Start over when the run folder holds a generate stage with a different config (a finished one
    stays in place until the new one is complete)."""
    cuda_graphs: str = "auto"
    """Our decoder (static KV caches, continuous batching: batch_size rows decode at once, a row
    whose answer ended takes the next prompt) replays every forward from a captured CUDA graph.
    auto: where the target is on one CUDA device; on: the same, an error elsewhere; off: never."""
    backend: str = "local"
    """local: the target decodes in this process (our decoder); server: OpenAI-compatible
    serving engines answer (generate.server), for targets that need one."""
    server: ServerConfig = field(default_factory=ServerConfig)
    retry_failed: bool = False
    """Ask the server again for the conversations a finished stage skipped after failed requests
    or malformed answers (and only them), merging them in; the stage's folder stays as it was
    until they are."""

    def __post_init__(self) -> None:
        _check_finite("generate", self)
        _check_choice("generate.backend", self.backend, GENERATE_BACKENDS)
        if self.backend == "server":
            if not self.server.urls:
                raise ValueError("generate.backend=server needs generate.server.urls=[http://host:port/v1, ...]")
            if self.target_answers < 1.0:
                raise ValueError("generate.backend=server regenerates every answer: set generate.target_answers=1 "
                                 "(scoring the source's answers needs the local backend)")
        for name in ("max_new_tokens", "batch_size", "shard_size", "max_length"):
            _check_positive(f"generate.{name}", getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"generate.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"generate.top_p must be in (0, 1], got {self.top_p}")
        if self.save_topk_logits < 0:
            raise ValueError(f"generate.save_topk_logits must be >= 0, got {self.save_topk_logits}")
        _check_choice("generate.cuda_graphs", self.cuda_graphs, GRAPH_CHOICES)
        if not 0.0 <= self.target_answers <= 1.0:
            raise ValueError(f"generate.target_answers must be in [0, 1], got {self.target_answers}")


@dataclass
class EvalConfig:
    """The eval stage: acceptance and speed of every drafter against plain decoding."""

    max_new_tokens: int = 256
    """Longest answer per turn."""
    temperature: float = 0.0
    """0 is greedy (outputs are then checked token for token against plain decoding)."""
    top_p: float = 1.0
    num_draft_tokens: str = "auto"
    """auto (the sweep value with the highest predicted speedup: τ and medians of interleaved
    cost timings, steady under machine noise) or a fixed number."""
    sweep: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6])
    """num_draft_tokens values measured for each drafter (with num_draft_tokens=auto)."""
    confidence_threshold: float = 0.0
    """> 0: the chains of draft_model, eagle and early_exit end early at a token the draft gave
    less than this probability (num_draft_tokens is then the longest chain), as transformers'
    assisted generation does; lossless either way. Prompt lookup, medusa and trees ignore it."""
    sweep_prompts: int = 3
    """Conversations (every turn) the sweep runs on; the chosen value then runs on all of them."""
    batch_size: int = 1
    """Prompts decoded together (speed is reported per batch size; 1 is the standard)."""
    batch_sizes: list[int] = field(default_factory=list)
    """Also measure every method (at its chosen k) and plain decoding at each of these batch
    sizes, e.g. [1,4,16,64]: speedup over plain by batch size, in the report and a plot
    (speculation pays at small batches and fades at large ones). A batch holds at most the
    conversations there are."""
    draft: Optional[str] = None
    """Another draft model folder (save_pretrained, same vocabulary) to measure as draft_model."""
    bundle: Optional[str] = None
    """An exported bundle (stage=export) to measure: checked against its checksums and this
    target's fingerprint, run at its own num_draft_tokens unless eval.num_draft_tokens is set."""
    engine: Optional[str] = None
    """llama.cpp: check eval.bundle in llama.cpp: our decoder measures plain decoding and the
    bundle's draft at its k (nothing else), and llama.cpp's llama-server serves the bundle's gguf/
    with and without the draft on the same prompts (identical tokens, its τ and acceptance,
    tokens/s, our replay of its answers); written into `<run>/eval-llama.cpp/` (the run's own
    eval stays as it is) and the bundle's bundle.json (engines). Under stage=all, the bundle
    the run exports is checked after export."""
    engine_repeats: int = 3
    """Repetitions of every prompt on each llama-server, interleaved; tokens/s are their medians."""
    max_prompts: Optional[int] = None
    """Evaluate only the first N conversations of the data (data.limit also limits generate under stage=all)."""
    ngram: bool = True
    """Measure prompt-lookup (ngram) drafting."""
    ngram_max: int = 3
    ngram_min: int = 2
    """Prompt lookup matches the last ngram_max..ngram_min tokens."""
    trees: bool = True
    """Also measure token trees for trained heads: medusa_tree (a static tree) and eagle_tree
    (EAGLE-2 dynamic trees), verified in one target pass, at batch size 1."""
    tree_budgets: list[int] = field(default_factory=lambda: [4, 8, 16])
    """Tree sizes (draft tokens per target pass) the sweep measures for tree methods."""
    tree_depth: int = 5
    """eagle_tree: depths expanded per round."""
    tree_topk: int = 4
    """eagle_tree: nodes expanded per depth, and children per expanded node."""
    medusa_choices: Optional[list[list[int]]] = None
    """medusa_tree: the static tree as Medusa's choices (paths of candidate ranks per head,
    e.g. [[0], [1], [0, 0]]); default: the most promising paths for each budget."""
    draft_int8: bool = True
    """On CPU, draft models (the distilled draft, eval.draft, a bundle's) and Medusa heads run
    their own linear layers in int8 with activations quantized per call (pipeline/kernels/linear.py):
    a draft step costs less, the target still verifies every token (lossless either way). EAGLE
    stays fp32 (it feeds its own features back, so the error compounds and τ drops), as does early
    exit (its draft is mostly the target's layers). false: everything fp32."""
    compare_draft_fp32: bool = False
    """With draft_int8, also measure each int8 draft model and head as it is in fp32, as `<name>:fp32`."""
    compare_hf: bool = False
    """Also run HF assisted generation and prompt lookup with the same drafts and num_draft_tokens."""
    cuda_graphs: str = "auto"
    """Our decoder (static KV caches, fixed shapes, acceptance on the device; the same code on
    every device) replays every target and draft forward from a captured CUDA graph. auto:
    where the target is on one CUDA device; on: the same, an error elsewhere; off: never."""
    decode_layout: bool = True
    """On CPU, our decoder runs few-row inputs of every linear layer through a small-batch
    product (pipeline/kernels/linear.py); HF's methods keep an untouched copy. false: both share
    the model as loaded."""

    def __post_init__(self) -> None:
        _check_finite("eval", self)
        if self.num_draft_tokens != "auto" and not (str(self.num_draft_tokens).isdigit() and int(self.num_draft_tokens) > 0):
            raise ValueError(f"eval.num_draft_tokens must be auto or a positive integer, got {self.num_draft_tokens!r}")
        if self.engine is not None:
            _check_choice("eval.engine", self.engine, ("llama.cpp",))
        for name in ("max_new_tokens", "sweep_prompts", "batch_size", "ngram_max", "ngram_min", "max_prompts",
                     "engine_repeats"):
            _check_positive(f"eval.{name}", getattr(self, name))
        if not self.sweep or min(self.sweep) < 1:
            raise ValueError(f"eval.sweep needs positive values, got {self.sweep}")
        if self.batch_sizes and min(self.batch_sizes) < 1:
            raise ValueError(f"eval.batch_sizes needs positive values, got {self.batch_sizes}")
        if not self.tree_budgets or min(self.tree_budgets) < 1:
            raise ValueError(f"eval.tree_budgets needs positive values, got {self.tree_budgets}")
        _check_positive("eval.tree_depth", self.tree_depth)
        _check_positive("eval.tree_topk", self.tree_topk)
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("eval.temperature must be >= 0 and eval.top_p in (0, 1]")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ValueError(f"eval.confidence_threshold must be in [0, 1), got {self.confidence_threshold}")
        if self.ngram_min > self.ngram_max:
            raise ValueError("eval.ngram_min must be <= eval.ngram_max")
        _check_choice("eval.cuda_graphs", self.cuda_graphs, GRAPH_CHOICES)

    @property
    def fixed_num_draft_tokens(self) -> Optional[int]:
        return None if self.num_draft_tokens == "auto" else int(self.num_draft_tokens)



@dataclass
class ExportConfig:
    """The export stage: the matched draft-target bundle of a run."""

    dir: Optional[str] = None
    """Where to write the bundle (default runs/<run>/export). An existing bundle there is replaced
    once the new one is complete; any other existing folder, and the run's own folders, are refused."""
    method: str = "draft_model"
    """What to export, with the numbers eval measured for it: draft_model (runs/<run>/distill),
    trained heads medusa, eagle or early_exit (runs/<run>/heads/<kind>), ngram (prompt lookup:
    settings only), or auto: the fastest lossless one eval measured (its tree, where a tree won)."""
    gguf: Optional[bool] = None
    """gguf/ for llama.cpp (the draft converted by llama.cpp's own converter, and its target):
    null writes it where llama.cpp can run the method and the converter is installed (`make
    setup-server`), else says why in one line; true requires it; false never writes it."""
    gguf_outtype: str = "f16"
    """The converter's --outtype for the draft (and for a target not loaded from a GGUF)."""

    def __post_init__(self) -> None:
        _check_choice("export.method", self.method, (*METHODS, "auto"))
        _check_choice("export.gguf_outtype", self.gguf_outtype, ("f32", "f16", "bf16", "q8_0"))


DRAFT_KINDS = ("new", "pretrained")
LOSS_KINDS = ("forward_kl", "reverse_kl", "jsd", "tv", "ce")
TEACHERS = ("auto", "online", "offline")
PRECISIONS = ("fp32", "bf16", "auto")


@dataclass
class DraftConfig:
    """The draft model distill trains: new (built from the target) or pretrained (an existing small LM)."""

    kind: str = "new"
    """new: the target's architecture with fewer layers; pretrained: `path`, same vocabulary as the target."""
    num_layers: int = 1
    """Decoder layers of a new draft."""
    init_layers: list[int] = field(default_factory=list)
    """Target layers copied into a new draft's layers, in order; negative counts from the end (empty: random)."""
    hidden_size: Optional[int] = None
    """A new draft's width (default the target's, which init from the target needs)."""
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    init_embeddings: bool = True
    """Start from the target's embeddings, LM head and final norm."""
    tie_embeddings: Optional[bool] = None
    """Share one matrix between the input embeddings and the LM head (default: as the target does)."""
    freeze_embeddings: bool = True
    """Keep the embeddings and LM head at their initial values (the target's): fewer parameters to learn."""
    path: Optional[str] = None
    """kind=pretrained: an HF model id or local folder."""
    lora_rank: int = 0
    """kind=pretrained: > 0 trains LoRA adapters of this rank (merged at save) instead of every weight."""
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    draft_vocab_size: int = 8192
    """Tokens the draft may propose: the most frequent answer tokens of the training data (the
    decoder computes only their LM-head rows, cutting the draft's cost). 0: the full vocabulary."""

    def __post_init__(self) -> None:
        _check_finite("draft", self)
        _check_choice("draft.kind", self.kind, DRAFT_KINDS)
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft.draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        _check_positive("draft.num_layers", self.num_layers)
        if self.kind == "pretrained" and not self.path:
            raise ValueError("draft.kind=pretrained needs draft.path=<HF id or folder>")
        if self.kind == "new" and self.freeze_embeddings and not self.init_embeddings:
            raise ValueError("draft.freeze_embeddings=true needs draft.init_embeddings=true "
                             "(frozen random embeddings never learn)")
        if self.lora_rank < 0:
            raise ValueError(f"draft.lora_rank must be >= 0, got {self.lora_rank}")


@dataclass
class TrainConfig:
    """What every training stage (distill, heads) sets the same way."""

    max_steps: int = 600
    """Optimizer steps."""
    batch_size: int = 8
    """Sequences per micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (global batch = batch_size x processes x grad_accum)."""
    max_length: int = 512
    """Sequences are cut to this many tokens."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    """Linear warm-up, then cosine decay to min_lr_ratio x lr."""
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    precision: str = "fp32"
    """fp32, bf16 (autocast through accelerate) or auto: bf16 where the device computes it
    natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else fp32. On a CPU without
    them bf16 is emulated and many times slower than fp32."""
    pack: bool = False
    """Pack each micro-batch's conversations into shared rows (as wide as its longest; attention
    causal within a conversation, blind across; positions restart), so fewer padding tokens are
    computed: the same learned positions and loss, less work where lengths vary."""
    eval_every: int = 100
    """Steps between held-out evaluations of the expected acceptance α = 1 - TV(p, q)."""
    eval_fraction: float = 0.05
    """Share of the generated conversations held out for that evaluation."""
    max_eval_sequences: int = 32
    save_every: int = 100
    """Steps between resumable checkpoints (model, optimizer, scheduler, data position, RNG)."""
    resume: bool = True
    """Continue from the last checkpoint of an unfinished run."""
    deepspeed: Optional[str] = None
    """A DeepSpeed config in conf/deepspeed/ (zero2, zero3) or a JSON path; set by `make distill-multi DS=`."""
    overwrite: bool = False
    """Train under a new config although the run folder holds a finished result of another one:
    the new run works beside it and replaces it only once complete. (A finished stage with the
    same config is always left as it is; without overwrite one with another config is refused.)"""

    def _check_training(self, node: str) -> None:
        _check_finite(node, self)
        _check_choice(f"{node}.precision", self.precision, PRECISIONS)
        for name in ("max_steps", "batch_size", "grad_accum", "max_length", "lr", "eval_every",
                     "max_eval_sequences", "save_every"):
            _check_positive(f"{node}.{name}", getattr(self, name))
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"{node}.eval_fraction must be in [0, 1), got {self.eval_fraction}")


@dataclass
class DistillConfig(TrainConfig):
    """The distill stage: train the draft to match the target's next-token distributions
    (experiment=recipe_cpu is the CPU recipe; its measured runs are in docs/)."""

    loss: str = "forward_kl"
    """forward_kl, reverse_kl, jsd, tv (1 - expected acceptance) or ce (the target's tokens only)."""
    temperature: float = 1.0
    """Softens target and draft alike in the KD losses."""
    jsd_beta: float = 0.5
    teacher: str = "auto"
    """offline: the top-k logits stored by generate (generate.save_topk_logits); online: the target
    runs in the loop (its full distribution); auto: offline when the dataset has them."""
    onpolicy_fraction: float = 0.0
    """Share of steps trained on continuations sampled from the draft itself and scored by the
    target (DistillSpec); needs the target in memory."""
    onpolicy_tokens: int = 32
    """Length of each sampled continuation."""

    def __post_init__(self) -> None:
        self._check_training("distill")
        _check_choice("distill.loss", self.loss, LOSS_KINDS)
        _check_choice("distill.teacher", self.teacher, TEACHERS)
        for name in ("temperature", "onpolicy_tokens"):
            _check_positive(f"distill.{name}", getattr(self, name))
        if not 0.0 <= self.onpolicy_fraction <= 1.0:
            raise ValueError(f"distill.onpolicy_fraction must be in [0, 1], got {self.onpolicy_fraction}")
        if self.loss == "ce" and self.onpolicy_fraction > 0:
            raise ValueError("distill.loss=ce learns the sampled tokens: on-policy steps would teach the draft "
                             "its own samples; use a KD loss with distill.onpolicy_fraction")
        if not 0.0 < self.jsd_beta < 1.0:
            raise ValueError(f"distill.jsd_beta must be in (0, 1), got {self.jsd_beta}")


@dataclass
class HeadsConfig(TrainConfig):
    """The heads stage: drafts that read the target's own hidden states (self-speculation).
    Choose one with heads=medusa|eagle|early_exit; each writes runs/<run>/heads/<kind>/."""

    kind: str = "eagle"
    """medusa (K heads on the last hidden state), eagle (one decoder layer over fused target
    features, autoregressive) or early_exit (the target's first layers + a trained exit adapter)."""
    precision: str = "auto"
    """As for every training stage; the heads default to auto (bf16 autocast with fp32 master
    weights where the device computes bf16 natively)."""
    pack: bool = True
    tree_budget: int = 8
    """The token tree (draft tokens per target pass) whose held-out τ chooses the checkpoint kept:
    of the evaluations every eval_every steps, the one with the best τ of such a tree (medusa,
    eagle; early exit: of a chain of 4) is the result, not the last."""
    draft_vocab_size: int = 8192
    """Tokens the heads may propose (the most frequent answer tokens of the training data), so
    their LM head costs a fraction of the target's. 0: the full vocabulary."""
    loss: str = "forward_kl"
    """forward_kl, reverse_kl, jsd or tv against the target's distribution (within the draft vocabulary)."""
    medusa_num_heads: int = 4
    """Medusa: head i predicts the token i+2 ahead of the last verified one."""
    medusa_num_layers: int = 1
    """Medusa: residual blocks per head."""
    medusa_decay: float = 0.8
    """Medusa: head i's loss is weighted medusa_decay**i."""
    feature_layers: list[int] = field(default_factory=list)
    """EAGLE: the target layers whose outputs are fused (EAGLE-3: low, middle, high); empty
    picks layers 2, L/2 and L-3 of an L-layer target. One layer [-1] is EAGLE-1 style."""
    ttt_steps: int = 3
    """EAGLE: training-time test, the head also learns from 2..ttt_steps steps of its own
    predicted features, as it drafts (1: teacher-forced features only)."""
    features: str = "online"
    """online: the frozen target runs in the training loop; offline: its hidden states are first
    cached to disk in fp16 shards (runs/<run>/heads/features/, resumable, the disk cost printed
    first), after which a step costs only the heads -- for more than one epoch."""
    cache_shard_size: int = 64
    """Sequences per feature-cache shard (heads.features=offline)."""
    features_dir: Optional[str] = None
    """Where the feature caches live (in <features_dir>/features/<key>/); default: the run's
    heads folder. A cache is keyed by the target, the data and the layers, so runs of the same
    data (a sweep of settings) can share one folder and cache once."""
    target_bf16: Optional[bool] = None
    """Run the frozen target's forward (its features and distributions) under bfloat16 autocast:
    about twice as fast on a CPU with AVX512-BF16, at bf16 rounding of what the heads learn from.
    null (the default): only where the device computes bf16 natively (many times slower elsewhere)."""
    exit_layer: int = 8
    """early_exit: the draft is the target's first exit_layer layers plus the adapter."""
    adapter_rank: int = 256
    """early_exit: width of the exit adapter's bottleneck."""

    def __post_init__(self) -> None:
        self._check_training("heads")
        _check_choice("heads.kind", self.kind, HEAD_KINDS)
        _check_choice("heads.loss", self.loss, ("forward_kl", "reverse_kl", "jsd", "tv"))
        _check_choice("heads.features", self.features, ("online", "offline"))
        for name in ("medusa_num_heads", "medusa_num_layers", "ttt_steps", "exit_layer", "adapter_rank",
                     "cache_shard_size", "tree_budget"):
            _check_positive(f"heads.{name}", getattr(self, name))
        if self.draft_vocab_size < 0:
            raise ValueError(f"heads.draft_vocab_size must be >= 0, got {self.draft_vocab_size}")


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
    draft: DraftConfig = field(default_factory=DraftConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logger: LoggerConfig = MISSING

    def __post_init__(self) -> None:
        check_run_name(self.run)
        if self.stage == "eval" and self.eval.engine and not self.eval.bundle:
            raise ValueError(f"eval.engine={self.eval.engine} checks an exported bundle: set eval.bundle=<bundle "
                             "folder> (stage=all checks the bundle it exports)")
        if not self.runs_dir.strip():
            raise ValueError("runs_dir must name a folder")


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="target", name="base_target", node=TargetConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="logger", name="base_logger", node=LoggerConfig)
    cs.store(group="draft", name="base_draft", node=DraftConfig)
    cs.store(group="heads", name="base_heads", node=HeadsConfig)


def to_config(cfg: DictConfig) -> Config:
    """The composed Hydra config as validated dataclasses (runs every `__post_init__`)."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]
