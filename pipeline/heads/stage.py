"""The heads stage: train Medusa heads, an EAGLE head or an early-exit adapter on the frozen
target's own hidden states (online: the target runs in the loop, no grad).

Input: `runs/<run>/generate/dataset`. Output (`runs/<run>/heads/<kind>/`):
  heads.safetensors    the trained weights and the draft vocabulary (draft_to_target)
  heads_config.json    kind and settings; load_heads rebuilds the rest from the target
  initial/             the same heads before training (the baseline)
  state/               the last resumable checkpoint (deleted when the run finishes)
  metrics.jsonl        loss, learning rate, held-out α, top-1 agreement and implied τ per logged step
  plan.json            the hash of what decides the weights
  manifest.json        written last, with the sha256 of the generate manifest it trained on

The loop is pipeline/train/loop.py's, shared with the distill stage: processes, DeepSpeed, resume,
overwrite (a finished stage stays until its replacement is complete), NaN checks and logging.
This stage supplies the heads, their loss on the target's features and their held-out evaluation:
α and top-1 agreement per draft position and the τ they imply for a chain of 4 and for a token
tree of heads.tree_budget nodes; the weights with the best held-out τ are kept (acceptance, not
the loss, chooses).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch

from pipeline.config import Config
from pipeline.distributed import native_bf16
from pipeline.errors import PipelineError
from pipeline.files import atomic_dir, remove, rename
from pipeline.heads.cache import FeatureCache, find_cache
from pipeline.heads.models import build_heads, feature_indices, own_state, save_heads
from pipeline.heads.train import RANKS, HeadsForTraining, Terms, target_layers, target_view, view_from_hidden
from pipeline.runs import stage_dir
from pipeline.train.data import answer_tokens, collate, frequent_tokens, load_examples, split_heldout
from pipeline.train.loop import Task, finish, start_training, train_steps

log = logging.getLogger(__name__)
STAGE = "heads"


def heads_settings(cfg: Config, target_config) -> dict:
    hc = cfg.heads
    if hc.kind == "medusa":
        return dict(num_heads=hc.medusa_num_heads, num_layers=hc.medusa_num_layers)
    if hc.kind == "eagle":
        return dict(feature_layers=list(feature_indices(target_config, list(hc.feature_layers))),
                    ttt_steps=hc.ttt_steps)
    return dict(exit_layer=hc.exit_layer, adapter_rank=hc.adapter_rank)


TREE_KINDS = ("medusa", "eagle")
"""The kinds eval also drafts token trees with: their held-out τ is a tree's."""


def tau(metrics: dict, shape: str) -> str:
    value = metrics.get(f"heldout_tau_{shape}_end")
    return f"{value:.2f}" if value is not None else "n/a"


def heads_dir(cfg: Config, kind: Optional[str] = None) -> Path:
    return stage_dir(cfg.runs_dir, cfg.run, STAGE) / (kind or cfg.heads.kind)


def plan_key(cfg: Config, gen_manifest: dict) -> str:
    settings = dataclasses.asdict(cfg.heads)
    for free in ("resume", "overwrite", "eval_every", "save_every", "max_eval_sequences", "cache_shard_size",
                 "features_dir"):
        settings.pop(free)
    key = dict(heads=settings, seed=cfg.seed, data=gen_manifest.get("outputs"),
               target=gen_manifest.get("target_fingerprint"))
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


CHAIN = 4
"""The chain whose held-out τ is reported beside the tree's (num_draft_tokens = 4)."""


class Tally:
    """Sums of α and top-1 agreement per draft position, and how often the target's token was
    the head's rank-r candidate there."""

    def __init__(self) -> None:
        self.alpha: list[float] = []
        self.top1: list[float] = []
        self.count: list[int] = []
        self.ranks: list[torch.Tensor] = []

    def add(self, terms: Terms) -> None:
        for i, (alpha, top1, rank) in enumerate(zip(terms.alpha, terms.top1, terms.rank)):
            if i == len(self.count):
                self.alpha.append(0.0), self.top1.append(0.0), self.count.append(0)
                self.ranks.append(torch.zeros(RANKS + 1, dtype=torch.long))
            self.alpha[i] += float(alpha.sum())
            self.top1[i] += float(top1.sum())
            self.count[i] += alpha.numel()
            self.ranks[i] += torch.bincount(rank.cpu(), minlength=RANKS + 1)

    def means(self, tree_budget: int, autoregressive: bool) -> dict:
        """The mean statistics per position and the τ they imply: of a chain of CHAIN tokens
        (an autoregressive draft's later positions taken as its last measured one) and, from
        the rank frequencies, of the best static tree of `tree_budget` nodes."""
        alpha = [a / n if n else None for a, n in zip(self.alpha, self.count)]
        top1 = [a / n if n else None for a, n in zip(self.top1, self.count)]
        chances = [(r[:RANKS].double() / n).tolist() for r, n in zip(self.ranks, self.count) if n]
        if autoregressive and chances:
            chances += [chances[-1]] * (CHAIN - len(chances))
        return dict(heldout_alpha=alpha[0] if alpha else None, heldout_top1=top1[0] if top1 else None,
                    heldout_alpha_by_position=alpha, heldout_top1_by_position=top1,
                    heldout_tau_chain=tree_tau([c[:1] for c in chances[:CHAIN]], CHAIN),
                    heldout_tau_tree=tree_tau(chances, tree_budget))


def tree_tau(chances: list[list[float]], budget: int) -> float:
    """1 + the expected tokens accepted from the best static tree of `budget` nodes, where
    chances[d][r] is how often the target's token at depth d+1 is the draft's rank-r candidate
    (its path accepted so far): a node is accepted with the product of its path's chances, and
    best-first over them is the best tree (a child never beats its parent). A chain is the
    tree of rank-0 nodes only."""
    import heapq

    heap = [(-c, (r,)) for r, c in enumerate(chances[0]) if c > 0] if chances else []
    heapq.heapify(heap)
    total = 0.0
    for _ in range(budget):
        if not heap:
            break
        weight, path = heapq.heappop(heap)
        total -= weight
        if len(path) < len(chances):
            for r, c in enumerate(chances[len(path)]):
                if c > 0:
                    heapq.heappush(heap, (weight * c, path + (r,)))
    return 1.0 + total


def run(cfg: Config) -> Path:
    t_start = time.perf_counter()
    hc = cfg.heads
    out = heads_dir(cfg)
    training = start_training(cfg, hc, STAGE, out, plan_key, kind=hc.kind)
    if training is None:
        return out
    accelerator, target, work, main = training.accelerator, training.target, training.work, training.main
    if hc.target_bf16 is None:  # null: bf16 only where the device computes it natively
        hc = dataclasses.replace(hc, target_bf16=native_bf16(accelerator.device.type))
        log.info("heads.target_bf16 null -> %s", hc.target_bf16)
    examples, skipped = load_examples(training.generate_dir / "dataset", hc.max_length)
    train, heldout = split_heldout(examples, hc.eval_fraction)
    heldout = heldout[: hc.max_eval_sequences]
    if not train:
        raise PipelineError(f"no conversation of {training.generate_dir} is left for training after holding "
                            f"{len(heldout)} out; generate more data or lower heads.eval_fraction")
    vocab_size = target.model.config.vocab_size
    if 0 < hc.draft_vocab_size < vocab_size:
        draft_vocab = frequent_tokens(answer_tokens(train), hc.draft_vocab_size, vocab_size)
    else:
        draft_vocab = torch.arange(vocab_size)
    held_tokens = torch.tensor(answer_tokens(heldout), dtype=torch.long)
    coverage = torch.isin(held_tokens, draft_vocab).float().mean().item() if len(held_tokens) else None
    pad_id = target.tokenizer.pad_token_id

    target_model = target.model.eval()
    heads = build_heads(hc.kind, target_model, draft_vocab.to(target.device), heads_settings(cfg, target_model.config))
    if hc.kind == "eagle":  # one target pass on the first training sequences sets fc's scales
        probe = collate(train[: hc.batch_size], pad_id, False).to(accelerator.device)
        with torch.no_grad():
            view = target_view(target_model, probe, heads.feature_layers, heads.draft_to_target)
        scales = heads.calibrate([view.hidden[i] for i in heads.feature_layers], probe.attention_mask.bool())
        log.info("heads: fc scaled by 1/%s for target layers %s", [round(x, 2) for x in scales],
                 list(heads.feature_layers))
    if main and not (work / "initial" / "heads_config.json").is_file():
        with atomic_dir(work / "initial", "checkpoint") as tmp:
            save_heads(heads, tmp)
    layers, vocab_ids = heads.feature_layers, heads.draft_to_target
    cache = None
    if hc.features == "offline":
        layers_needed = target_layers(target_model, layers)
        data_key = json.dumps(training.gen_manifest.get("outputs"), sort_keys=True) + f"/heldout={hc.eval_fraction}"
        root = Path(hc.features_dir) if hc.features_dir else stage_dir(cfg.runs_dir, cfg.run, STAGE)
        folder, cached = find_cache(root, training.fingerprint, layers_needed,
                                    data_key, hc.max_length, hc.target_bf16)
        if cached != layers_needed:
            log.info("heads: layers %s read from the feature cache of layers %s (%s)", layers_needed, cached, folder.name)
        cache = FeatureCache(folder, cached, target_model.config.hidden_size, hc.cache_shard_size)
        if main:
            cache.build(target_model, train, pad_id, hc.batch_size * hc.max_length, hc.target_bf16)
        accelerator.wait_for_everyone()

    def loss(model, micro: list[int], drawn: dict) -> tuple[torch.Tensor, int]:
        batch = collate([train[i] for i in micro], pad_id, False, hc.pack)
        tokens = int(batch.attention_mask.sum())  # counted on the host: no device sync
        batch = batch.to(accelerator.device)
        if cache is not None:
            view = view_from_hidden(target_model, cache.hidden(micro, batch), batch, vocab_ids, hc.target_bf16)
        else:
            view = target_view(target_model, batch, layers, vocab_ids, hc.target_bf16)
        return model(view, batch).loss, tokens

    # EAGLE's held-out chains go as deep as eval drafts (its trees' depth, a chain of CHAIN).
    depth = max(hc.ttt_steps, CHAIN, cfg.eval.tree_depth) if hc.kind == "eagle" else None

    heldout_views = []  # the target's side of each held-out batch: the same at every evaluation

    def evaluate(model) -> dict:
        if not heldout:
            return {}
        if not heldout_views:
            for start in range(0, len(heldout), hc.batch_size):
                batch = collate(heldout[start : start + hc.batch_size], pad_id, False).to(accelerator.device)
                heldout_views.append((batch, target_view(target_model, batch, layers, vocab_ids, stats=True)))  # fp32
        tally = Tally()
        for batch, view in heldout_views:
            tally.add(model(view, batch, depth))
        return tally.means(hc.tree_budget, autoregressive=hc.kind != "medusa")

    if main:
        log.info("heads: %s, %d train / %d held-out conversations (%d skipped), loss %s, draft vocabulary %d "
                 "(held-out coverage %s)", hc.kind, len(train), len(heldout), sum(skipped.values()), hc.loss,
                 len(draft_vocab), f"{coverage:.3f}" if coverage is not None else "n/a")
    model = HeadsForTraining(heads.train(), target_model, hc.loss, hc.medusa_decay, hc.ttt_steps)
    select = "heldout_tau_tree" if hc.kind in TREE_KINDS else "heldout_tau_chain"
    trained, state_dict, metrics = train_steps(training, Task(model, len(train), loss, evaluate, select=select))
    if main:
        train_s = time.perf_counter() - t_start
        metrics = dict(kind=hc.kind, features=hc.features, **metrics, train_conversations=len(train),
                       heldout_conversations=len(heldout), skipped_records=skipped, wall_time_s=train_s,
                       draft_vocab_size=len(draft_vocab), draft_vocab_heldout_coverage=coverage)
        state = {k: v for k, v in state_dict.items() if k in own_state(trained)} if state_dict is not None else None
        with atomic_dir(work / "final", "checkpoint") as tmp:
            save_heads(trained, tmp, extra=dict(target=target.name, target_fingerprint=training.fingerprint),
                       state=state)
        for name in ("heads.safetensors", "heads_config.json"):
            rename(work / "final" / name, work / name)
        remove(work / "final")
        finish(training, metrics)

        def top1(when: str) -> str:
            value = metrics.get(f"heldout_top1_{when}")
            return f"{value:.3f}" if value is not None else "n/a"

        print(f"{training.name}: {hc.max_steps} steps in {train_s / 60:.1f} min, final loss {metrics['final_loss']:.4f}"
              f", held-out top-1 agreement at draft position 1 {top1('start')} -> {top1('end')}, held-out τ "
              f"{tau(metrics, 'chain')} for a chain of {CHAIN}, {tau(metrics, 'tree')} for a tree of {hc.tree_budget} "
              f"(the weights of step {metrics.get('selected_step', hc.max_steps)}) -> {out}")
    accelerator.wait_for_everyone()
    return out
