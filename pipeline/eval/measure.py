"""Run one decoding method over multi-turn prompts and measure it: tokens/s, τ, α, per category.

Every method decodes the same conversations turn by turn; a later turn continues from the
method's own earlier answers (identical across methods when greedy decoding is lossless).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

import torch

from pipeline.config import TIMING_NOISE
from pipeline.data.chat import first_prompt_ids, next_turn_ids
from pipeline.data.sources import Conversation
from pipeline.decode import DecodeResult, StaticModel, plain_decode, speculative_decode, tree_decode
from pipeline.decode.types import Sequences
from pipeline.kinds import DraftOptions, kind_of_method

Decode = Callable[[list[list[int]]], DecodeResult]
HF_METHODS = ("hf_generate", "hf_prompt_lookup", "hf_assisted")


@dataclass
class Settings:
    """What every method shares: the target, the stopping rule and the sampling rule."""

    model: torch.nn.Module
    tokenizer: object
    eos_ids: set[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    drafting: DraftOptions = DraftOptions()
    """How drafters propose (n-gram lengths, tree shapes, confidence stops); its temperature,
    top_p and generator are replaced by the ones above and each method's own."""
    hf_model: Optional[torch.nn.Module] = None
    """The target as transformers lays it out, for HF's methods (default: `model`)."""
    graphs: bool = False
    """Replay every forward of our decoder from a captured CUDA graph (eval.cuda_graphs)."""
    target: Optional[StaticModel] = None
    """`model` for our decoder (made from it by default). Every method shares it: one static
    cache, one captured forward per verify width."""

    def __post_init__(self) -> None:
        if self.target is None:
            self.target = StaticModel(self.model, self.graphs)


@dataclass
class Counts:
    tokens: int = 0
    seconds: float = 0.0
    target_passes: int = 0
    answers: int = 0

    def add(self, tokens: int, seconds: float, passes: int) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.target_passes += passes
        self.answers += 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> Optional[float]:
        return self.tokens / self.target_passes if self.target_passes else None


@dataclass
class Measurement:
    drafter: str
    num_draft_tokens: Optional[int]
    total: Counts = field(default_factory=Counts)
    per_category: dict[str, Counts] = field(default_factory=lambda: defaultdict(Counts))
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    """conversation id -> emitted tokens of each turn."""
    contexts: dict[str, list[list[int]]] = field(default_factory=dict)
    """conversation id -> the context each turn was decoded from."""

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    @property
    def proposal_rate(self) -> float:
        """Share of verification passes with at least one proposal (below 1 when prompt lookup finds no match)."""
        steps = self.total.target_passes - self.total.answers  # every answer's first pass is its prefill
        return self.proposed_by_position[0] / steps if steps > 0 and self.proposed_by_position else 0.0


def make_decode(drafter: str, settings: Settings, num_draft_tokens: Optional[int] = None,
                draft_model: Optional[torch.nn.Module] = None) -> Decode:
    """A function prompts -> DecodeResult for one method (plain, an HF method, a kind or its
    `<kind>_tree`) at one num_draft_tokens (a tree's: its budget)."""
    s = settings
    generator = torch.Generator(device=next(s.model.parameters()).device).manual_seed(s.seed)
    common = dict(max_new_tokens=s.max_new_tokens, eos_ids=s.eos_ids, temperature=s.temperature, top_p=s.top_p,
                  generator=generator)
    if drafter == "plain":
        return lambda prompts: plain_decode(s.target, prompts, **common)
    if drafter in HF_METHODS:
        return hf_decode(drafter, settings, num_draft_tokens, draft_model)
    kind, tree = kind_of_method(drafter)
    options = dataclasses.replace(s.drafting, temperature=s.temperature, top_p=s.top_p, generator=generator,
                                  graphs=s.graphs)
    made = kind.drafter(draft_model, s.model, options)  # one drafter for every call: its caches and graphs are kept
    if tree:
        return lambda prompts: tree_decode(s.target, made, prompts, budget=num_draft_tokens, **common)
    return lambda prompts: speculative_decode(s.target, made, prompts, num_draft_tokens=num_draft_tokens, **common)


def hf_decode(kind: str, settings: Settings, num_draft_tokens: Optional[int], draft_model) -> Decode:
    """transformers' own generate (batch 1): plain, prompt lookup, or assisted with a draft model."""
    from transformers import GenerationConfig

    s = settings
    extra = {}
    if kind == "hf_prompt_lookup":
        extra = dict(prompt_lookup_num_tokens=num_draft_tokens, max_matching_ngram_size=s.drafting.ngram_max)
    elif kind == "hf_assisted":
        # The same fixed number of draft tokens per step as ours, no early stop on confidence.
        extra = dict(num_assistant_tokens=num_draft_tokens, num_assistant_tokens_schedule="constant",
                     assistant_confidence_threshold=0.0)
    sampling = dict(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0) if s.temperature > 0 \
        else dict(do_sample=False)
    config = GenerationConfig(max_new_tokens=s.max_new_tokens, eos_token_id=sorted(s.eos_ids),
                              pad_token_id=s.tokenizer.pad_token_id, **sampling, **extra)
    assistant = dict(assistant_model=draft_model) if kind == "hf_assisted" else {}
    model = s.hf_model if s.hf_model is not None else s.model

    def decode(prompts: list[list[int]]) -> DecodeResult:
        tokens = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=next(model.parameters()).device)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                       **assistant)
            new = out[0, ids.shape[1]:].tolist()
            tokens.append(new[: next((i + 1 for i, t in enumerate(new) if t in s.eos_ids), len(new))])
        return DecodeResult(tokens, target_passes=[0] * len(prompts))  # HF does not report its passes

    return decode


def _sync(model) -> None:
    if model is not None and next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


@dataclass
class Method:
    decode: Decode
    drafter: str
    num_draft_tokens: Optional[int] = None


def measure(
    methods: dict[str, Method], conversations: list[Conversation], settings: Settings, *,
    batch_size: int = 1, max_turns: Optional[int] = None, on_step: Optional[Callable[[int], None]] = None,
) -> dict[str, Measurement]:
    """Decode every turn of every conversation with every method and time only the decoding.

    The methods take turns on each batch of prompts, in rotating order, so that a slow
    stretch of a shared or throttled machine hits every method alike.
    """
    results = {name: Measurement(drafter=m.drafter, num_draft_tokens=m.num_draft_tokens) for name, m in methods.items()}
    answers = {name: {c.id: [] for c in conversations} for name in methods}
    for r in results.values():
        for c in conversations:
            r.outputs[c.id], r.contexts[c.id] = [], []
    turns = max(len(c.user_turns) for c in conversations)
    order = list(methods)
    for turn in range(min(turns, max_turns or turns)):
        live = [c for c in conversations if turn < len(c.user_turns)]
        for start in range(0, len(live), batch_size):
            batch = live[start : start + batch_size]
            for name in order:
                _measure_batch(methods[name].decode, results[name], answers[name], batch, turn, settings)
                if on_step:
                    on_step(len(batch))
            order = order[1:] + order[:1]
    return results


def _measure_batch(decode: Decode, m: Measurement, answers: dict[str, list[str]], batch: list[Conversation],
                   turn: int, s: Settings) -> None:
    tok = s.tokenizer
    contexts = []
    for c in batch:
        if turn == 0:
            contexts.append(first_prompt_ids(tok, c))
        else:  # continue from this method's own earlier answer
            prev_context, prev_out = m.contexts[c.id][-1], m.outputs[c.id][-1]
            last = prev_out[-1] if prev_out else prev_context[-1]
            contexts.append(prev_context + prev_out + next_turn_ids(tok, c, turn, answers[c.id], last, s.eos_ids))
    _sync(s.model)
    t0 = time.perf_counter()
    result = decode(contexts)
    _sync(s.model)
    seconds = time.perf_counter() - t0
    emitted = sum(len(t) for t in result.tokens)
    for c, context, out, passes in zip(batch, contexts, result.tokens, result.target_passes):
        m.contexts[c.id].append(context)
        m.outputs[c.id].append(out)
        answers[c.id].append(tok.decode(out, skip_special_tokens=True))
        # In a batch, each row is charged the batch time in proportion to its tokens.
        share = seconds * len(out) / emitted if emitted else 0.0
        m.total.add(len(out), share, passes)
        m.per_category[c.category or "uncategorized"].add(len(out), share, passes)
    _add_positions(m, result)


def _add_positions(m: Measurement, result: DecodeResult) -> None:
    for name in ("proposed_by_position", "accepted_by_position"):
        mine, theirs = getattr(m, name), getattr(result, name)
        mine.extend([0] * (len(theirs) - len(mine)))
        for i, n in enumerate(theirs):
            mine[i] += n


@dataclass
class Divergence:
    conversation: str
    turn: int
    position: int
    tie: bool
    """The target's two best logits at the first differing position are closer than tie_epsilon."""


def tie_epsilon(dtype: torch.dtype) -> float:
    """The top-2 logit gap below which two greedy decoders of the same model may disagree: forwards
    of different widths round differently, by float32 noise, or by a few bf16/fp16 units at
    the size of LM logits (bf16 keeps 8 significant bits: steps of 0.125 between 16 and 32)."""
    return {torch.bfloat16: 0.25, torch.float16: 0.05}.get(dtype, 1e-4)


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    """The first position where two token lists differ (the shorter one's length where one is a
    prefix of the other); None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def greedy_divergences(model, reference: Measurement, other: Measurement,
                       epsilon: Optional[float] = None) -> list[Divergence]:
    """Where `other`'s greedy outputs differ from `reference`'s (later turns of a diverged
    conversation are not compared: their contexts differ); `tie` where the reference's top-2
    logits there are closer than epsilon (default: tie_epsilon of the model's dtype)."""
    if epsilon is None:
        epsilon = tie_epsilon(next(model.parameters()).dtype)
    found = []
    for conv, turns in reference.outputs.items():
        for turn, (want, got) in enumerate(zip(turns, other.outputs[conv])):
            if want == got:
                continue
            i = first_divergence(want, got)
            context = reference.contexts[conv][turn] + want[:i]
            logits = model(torch.tensor([context], device=next(model.parameters()).device)).logits[0, -1]
            top2 = logits.float().topk(2).values
            found.append(Divergence(conv, turn, i, bool(top2[0] - top2[1] < epsilon)))
            break
    return found


def forward_step(model: StaticModel, new_tokens: int, context: int = 128,
                 logits_to_keep: int = 0) -> Callable[[], torch.Tensor]:
    """One forward of `new_tokens` tokens after a cached `context` (random tokens; a CUDA graph
    replay where the model replays them), as a call that leaves the cache as it found it: a
    target's verification, or a draft's step."""
    gen = torch.Generator().manual_seed(0)
    model.ready(1, context + new_tokens + 1)
    tokens = torch.randint(0, model.model.config.vocab_size, (1, model.max_len), generator=gen).to(model.device)
    with torch.inference_mode():  # the static buffers are inference tensors
        model.prefill(tokens, torch.tensor([context], device=model.device))
        replay, inputs = model.replay(new_tokens, logits_to_keep)
        inputs.tokens.copy_(tokens[:, context : context + new_tokens])
        inputs.start.fill_(context)
        inputs.positions.copy_(context + torch.arange(new_tokens, device=model.device))
    return replay


def heads_step(heads, target, graphs: bool, context: int = 128) -> tuple[Callable[[], object], int]:
    """One draft step of a head module and the draft tokens it yields: one EAGLE step (a replay)
    after `context` slots of its static cache, one early-exit forward, or all Medusa heads on
    one hidden state (one token per head)."""
    from pipeline.decode.static_kv import use_static_attention

    if heads.kind == "medusa":
        hidden = torch.randn((1, target.config.hidden_size), dtype=next(target.parameters()).dtype,
                             device=next(target.parameters()).device)
        return (lambda: heads(hidden)), heads.num_heads
    if heads.kind == "early_exit":
        from pipeline.heads.models import early_exit_model

        return forward_step(StaticModel(early_exit_model(target, heads), graphs), 1, context, logits_to_keep=1), 1
    use_static_attention(heads.decoder)
    static = StaticModel(heads, graphs)
    static.ready(1, context + 2)
    size = heads.config.hidden_size
    with torch.inference_mode():
        replay, inputs = static.replay(1, logits_to_keep=1, feature_width=size)
        inputs.start.fill_(context)
        inputs.positions.fill_(context)
        inputs.features.copy_(torch.randn((1, 1, size), generator=torch.Generator().manual_seed(0)))
    return replay, 1


def tree_round_step(drafter, target, budget: int, context: int = 128) -> Callable[[], None]:
    """One drafting round of a tree drafter (all its draft work per target pass) after a cached
    `context` of random tokens, then one accepted position for the next round to catch up on."""
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    gen = torch.Generator().manual_seed(0)
    seqs = Sequences(torch.randint(0, target.config.vocab_size, (1, context + budget + 8), generator=gen).to(device),
                     torch.tensor([context + 1], device=device))  # a prompt of `context` tokens and the first answer
    width = len(drafter.feature_layers) * target.config.hidden_size
    features = torch.randn((1, context, width), generator=gen).to(device=device, dtype=dtype)
    first, one = torch.tensor([context - 1], device=device), torch.ones(1, dtype=torch.long, device=device)
    with torch.inference_mode():
        drafter.start(seqs, seqs.tokens.shape[1])
        drafter.observe(features, torch.zeros_like(first), seqs.lengths - 1)

    def step() -> None:
        drafter.propose_tree(seqs, budget)
        drafter.observe(features[:, -1:], first, one)

    return step


@torch.inference_mode()
def median_seconds(steps: dict[Hashable, Callable[[], None]], sync_model, reps: int = 9,
                   warmup: int = 2, clock: Callable[[], float] = time.perf_counter) -> dict[Hashable, float]:
    """Median time of each call, timed round-robin (every call once per round) so that the
    machine's drift over the seconds this takes touches them all alike, and a stall that hits
    a few rounds (another process taking the cores) moves no median: the costs are ratios of
    these times, from which eval predicts each method's speedup and picks its num_draft_tokens."""
    times: dict[Hashable, list[float]] = {name: [] for name in steps}
    for round_ in range(warmup + reps):
        for name, step in steps.items():
            _sync(sync_model)
            t0 = clock()
            step()
            _sync(sync_model)
            if round_ >= warmup:
                times[name].append(clock() - t0)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def best_num_draft_tokens(rows: list[dict], near: float = TIMING_NOISE) -> int:
    """The sweep value to run a method at: the smallest whose predicted speedup is within `near`
    of the highest (its parts are τ, which greedy decoding fixes, and the medians of interleaved
    cost timings), so that the choice does not follow a sweep's wall-clock noise (one busy
    stretch can make any value look fastest) nor the last percent of timing noise between
    values that predict the same (among equals the smallest is the cheapest to run). Where some
    value has no prediction (chains that end early on
    confidence), the highest measured tokens/s of the round-robin sweep."""
    rows = sorted(rows, key=lambda r: r["num_draft_tokens"])
    if all(r["predicted_speedup"] is not None for r in rows):
        best = max(r["predicted_speedup"] for r in rows)
        return next(r for r in rows if r["predicted_speedup"] >= best * (1 - near))["num_draft_tokens"]
    return max(rows, key=lambda r: r["tokens_per_s"])["num_draft_tokens"]


def expected_tokens_per_pass(acceptance_by_position: list[float], proposal_rate: float = 1.0) -> float:
    """1 + r * sum_i prod_{j<=i} alpha_j: the target's own token plus the expected accepted run,
    on the share r of passes that carry a proposal."""
    run, accepted = 1.0, 0.0
    for alpha in acceptance_by_position:
        run *= alpha
        accepted += run
    return 1.0 + proposal_rate * accepted


def predicted_speedup(acceptance_by_position: list[float], draft_cost: float, verify_cost: float,
                      proposal_rate: float = 1.0) -> float:
    """Tokens per unit of target time over plain decoding's one token per pass.

    draft_cost c: one draft forward / one target forward; verify_cost v: one target forward of
    k+1 tokens / one of a single token (close to 1 on GPUs, more on small CPUs); a pass
    without a proposal costs 1:  (1 + r * sum_i prod_j alpha_j) / (1 + r * (v - 1) + k * c).
    """
    k = len(acceptance_by_position)
    cost = 1.0 + proposal_rate * (verify_cost - 1.0) + k * draft_cost
    return expected_tokens_per_pass(acceptance_by_position, proposal_rate) / cost
