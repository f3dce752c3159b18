"""The distill stage: train a draft model to match the target's next-token distributions.

Input: `runs/<run>/generate/dataset` (the target's own answers, optionally its top-k logits).
Output (`runs/<run>/distill/`):
  checkpoint/    the trained draft: save_pretrained (safetensors) + the target's tokenizer
  initial/       the same draft before training (the baseline its τ is compared with)
  state/         the last resumable checkpoint (deleted when the run finishes)
  metrics.jsonl  loss, learning rate and held-out α per logged step
  plan.json      the hash of what decides the weights (draft, settings, data, seed)
  manifest.json  written last, with the sha256 of the generate manifest it trained on

A finished stage with the same plan is left as it is; another plan needs distill.overwrite=true
and trains in `.next-distill/` beside it, which replaces it only once complete.

One process on a laptop; `accelerate launch` / `torchrun` for N processes (DDP over gloo on
CPUs, NCCL on GPUs); `distill.deepspeed=zero2|zero3` for DeepSpeed ZeRO. The loop, its
checkpoints and resume are pipeline/train/loop.py's; this stage supplies the draft, its loss
(on-policy steps included) and its held-out evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from pipeline.config import Config, DistillConfig
from pipeline.distill.draft import add_lora, check_vocabulary, new_draft, pretrained_draft, save_draft
from pipeline.errors import PipelineError
from pipeline.files import atomic_dir
from pipeline.runs import stage_dir
from pipeline.train.data import Batch, Example, answer_tokens, collate, frequent_tokens, load_examples, split_heldout
from pipeline.train.loop import Task, finish, start_training, train_steps
from pipeline.train.losses import DraftVocab, Teacher, distill_loss, expected_acceptance, top1_agreement

log = logging.getLogger(__name__)
STAGE = "distill"


def selected_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    rows: torch.Tensor, cols: torch.Tensor, vocab: Optional[torch.Tensor] = None,
                    position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The model's logits at the batch's learned positions only. [N, V], or [N, len(vocab)]
    over the LM-head rows `vocab` only. attention_mask: [B, T], or Batch.model_mask's [B, 1, T, T]
    with position_ids for packed rows.

    The LM head (49k x 576 for the embedded target) runs on those N positions instead of
    every token, which halves its cost on chat data where prompts are half the tokens; a draft
    vocabulary of 8192 tokens cuts the rest by 6x.
    """
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    if vocab is None:
        logits = head(hidden[rows, cols])
    elif hasattr(head.weight, "ds_id"):  # ZeRO-3 gathers the weight only inside the head's own call
        logits = head(hidden[rows, cols])[:, vocab]
    else:
        bias = head.bias[vocab] if head.bias is not None else None
        logits = F.linear(hidden[rows, cols], head.weight[vocab], bias)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


class DraftForDistill(torch.nn.Module):
    """The draft behind one forward(batch) -> logits [N, V] (or over its draft vocabulary), so
    DDP and DeepSpeed see every call."""

    def __init__(self, draft: torch.nn.Module, vocab: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.draft = draft
        self.register_buffer("vocab", vocab, persistent=False)

    def forward(self, input_ids, attention_mask, rows, cols, position_ids=None) -> torch.Tensor:
        return selected_logits(self.draft, input_ids, attention_mask, rows, cols, self.vocab, position_ids)


def build_draft(cfg: Config, target) -> torch.nn.Module:
    d = cfg.draft
    if d.kind == "new":
        draft = new_draft(target.model, num_layers=d.num_layers, init_layers=d.init_layers, hidden_size=d.hidden_size,
                          intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
                          num_key_value_heads=d.num_key_value_heads, tie_embeddings=d.tie_embeddings,
                          init_embeddings=d.init_embeddings)
    else:
        draft = pretrained_draft(d.path, target.model, trust_remote_code=cfg.target.trust_remote_code)
    check_vocabulary(draft, target.model, d.path or "new")
    if d.freeze_embeddings:
        for module in (draft.get_input_embeddings(), draft.get_output_embeddings()):
            module.weight.requires_grad_(False)
    if d.kind == "pretrained" and d.lora_rank:
        draft = add_lora(draft, rank=d.lora_rank, alpha=d.lora_alpha, dropout=d.lora_dropout,
                         target_modules=list(d.lora_target_modules))
    return draft.train()


@torch.no_grad()
def teacher_for(target_model: Optional[torch.nn.Module], batch: Batch) -> Teacher:
    if batch.teacher is not None:
        return batch.teacher
    return Teacher(selected_logits(target_model, batch.input_ids, batch.model_mask(), batch.rows, batch.cols,
                                   position_ids=batch.position_ids).float())


@torch.no_grad()
def heldout_acceptance(model, target_model, examples: list[Example], pad_id: int, offline: bool,
                       batch_size: int, device, vocab: Optional[DraftVocab] = None,
                       pack: bool = False) -> tuple[float, float]:
    """Mean expected acceptance α = 1 − TV(p, q) and top-1 agreement over the held-out positions."""
    alpha_sum, top1_sum, count = 0.0, 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size], pad_id, offline, pack).to(device)
        logits = model(batch.input_ids, batch.model_mask(), batch.rows, batch.cols, batch.position_ids)
        teacher = teacher_for(target_model, batch)
        alpha_sum += float(expected_acceptance(logits, teacher, vocab).sum())
        top1_sum += float(top1_agreement(logits, teacher, vocab).sum())
        count += len(logits)
    return alpha_sum / max(count, 1), top1_sum / max(count, 1)


def draft_loss(dc: DistillConfig, logits: torch.Tensor, teacher: Teacher, labels: torch.Tensor,
               vocab: Optional[DraftVocab]) -> torch.Tensor:
    """The configured loss; over a draft vocabulary, against the teacher renormalised to it."""
    if vocab is not None:
        if dc.loss == "ce":
            labels = vocab.labels(labels)
            keep = labels >= 0
        else:
            teacher, keep = vocab.teacher(teacher)
        if not bool(keep.any()):  # nothing the draft can propose: no gradient, not a NaN
            return logits.sum() * 0.0
        logits, labels = logits[keep], labels[keep]
    return distill_loss(dc.loss, logits, teacher, labels, dc.temperature, dc.jsd_beta)


@torch.no_grad()
def onpolicy_batch(draft: torch.nn.Module, examples: list[Example], num_tokens: int, pad_id: int,
                   generator: torch.Generator, device, vocab: Optional[torch.Tensor] = None) -> Batch:
    """Continuations sampled from the draft after each example's first prompt (DistillSpec),
    from its draft vocabulary `vocab` when it has one, as it will propose."""
    prompts = [ex.input_ids[: ex.positions[0] + 1] for ex in examples]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width + num_tokens), pad_id, dtype=torch.long)
    valid = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding for sampling
        ids[i, width - len(p) : width] = torch.tensor(p)
        valid[i, width - len(p) : width] = 1
    ids, valid = ids.to(device), valid.to(device)
    was_training = draft.training
    draft.eval()
    for t in range(width, width + num_tokens):  # short continuations: a cache buys little here
        logits = draft(input_ids=ids[:, :t], attention_mask=valid[:, :t]).logits[:, -1].float()
        if vocab is not None:
            logits = logits[:, vocab]
        drawn = torch.multinomial(torch.softmax(logits, dim=-1).cpu(), 1, generator=generator).squeeze(1).to(device)
        ids[:, t] = vocab[drawn] if vocab is not None else drawn
        valid[:, t] = 1
    draft.train(was_training)
    rows = torch.arange(len(prompts), device=device).repeat_interleave(num_tokens)
    cols = torch.arange(width - 1, width + num_tokens - 1, device=device).repeat(len(prompts))
    return Batch(ids, valid, rows, cols, ids[rows, cols + 1])


def plan_key(cfg: Config, gen_manifest: dict) -> str:
    """A hash of what decides the trained weights: draft, training settings, data, seed."""
    import hashlib

    settings = dataclasses.asdict(cfg.distill)
    for free in ("resume", "overwrite", "eval_every", "save_every", "max_eval_sequences"):
        settings.pop(free)
    if not settings["pack"]:  # the default: keeps plans from before the option
        settings.pop("pack")
    key = dict(draft=dataclasses.asdict(cfg.draft), distill=settings, seed=cfg.seed,
               data=gen_manifest.get("outputs"), target=gen_manifest.get("target_fingerprint"))
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def run(cfg: Config) -> Path:
    t_start = time.perf_counter()
    dc = cfg.distill
    out = stage_dir(cfg.runs_dir, cfg.run, STAGE)
    training = start_training(cfg, dc, STAGE, out, plan_key)
    if training is None:
        return out
    accelerator, target, work, main = training.accelerator, training.target, training.work, training.main
    generate_dir = training.generate_dir
    examples, skipped = load_examples(generate_dir / "dataset", dc.max_length)
    has_topk = examples[0].topk_ids is not None
    offline = dc.teacher == "offline" or (dc.teacher == "auto" and has_topk)
    if offline and not has_topk:
        raise PipelineError(f"distill.teacher=offline needs top-k logits in {generate_dir}: "
                            "run generate with generate.save_topk_logits=<k>")
    train, heldout = split_heldout(examples, dc.eval_fraction)
    heldout = heldout[: dc.max_eval_sequences]
    if not train:
        raise PipelineError(f"no conversation of {generate_dir} is left for training after holding "
                            f"{len(heldout)} out; generate more data or lower distill.eval_fraction")
    vocab_size = target.model.config.vocab_size
    draft_vocab, coverage = None, None
    if 0 < cfg.draft.draft_vocab_size < vocab_size:
        draft_vocab = frequent_tokens(answer_tokens(train), cfg.draft.draft_vocab_size, vocab_size)
        held_tokens = torch.tensor(answer_tokens(heldout), dtype=torch.long)
        if len(held_tokens):
            coverage = torch.isin(held_tokens, draft_vocab).float().mean().item()
    pad_id = target.tokenizer.pad_token_id

    draft = build_draft(cfg, target)
    target_model = target.model.eval() if not offline or dc.onpolicy_fraction > 0 else None
    if target_model is None:
        target.model = None  # an offline teacher needs no target weights past this point
    # The untrained baseline of this plan: written afresh unless this run resumes its own.
    if main and not (training.resuming and (work / "initial" / "config.json").is_file()):
        with atomic_dir(work / "initial", "checkpoint") as tmp:
            save_draft(draft, target.tokenizer, tmp, draft_vocab=draft_vocab)
    vocab = DraftVocab(draft_vocab.to(accelerator.device), vocab_size) if draft_vocab is not None else None
    onpolicy_rng = torch.Generator().manual_seed(cfg.seed + 1)

    def draw_step() -> dict:
        return dict(onpolicy=dc.onpolicy_fraction > 0
                    and float(torch.rand((), generator=onpolicy_rng)) < dc.onpolicy_fraction)

    def loss(model, micro: list[int], drawn: dict) -> tuple[torch.Tensor, int]:
        chosen = [train[i] for i in micro]
        if drawn["onpolicy"]:
            batch = onpolicy_batch(draft, chosen, dc.onpolicy_tokens, pad_id, onpolicy_rng, accelerator.device,
                                   vocab.ids if vocab is not None else None)
            tokens = int(batch.attention_mask.sum())
        else:
            batch = collate(chosen, pad_id, offline, dc.pack)
            tokens = int(batch.attention_mask.sum())  # counted on the host: no device sync
            batch = batch.to(accelerator.device)
        logits = model(batch.input_ids, batch.model_mask(), batch.rows, batch.cols, batch.position_ids)
        value = draft_loss(dc, logits, teacher_for(target_model, batch), batch.labels, vocab)
        return value, tokens

    def evaluate(model) -> dict:
        if not heldout:
            return dict(heldout_alpha=None, heldout_top1=None)
        alpha, top1 = heldout_acceptance(model, target_model, heldout, pad_id, offline, dc.batch_size,
                                         accelerator.device, vocab, dc.pack)
        return dict(heldout_alpha=alpha, heldout_top1=top1)

    if main:
        log.info("distill: %d train / %d held-out conversations (%d skipped), teacher %s, loss %s",
                 len(train), len(heldout), sum(skipped.values()), "offline top-k" if offline else "online", dc.loss)
    task = Task(DraftForDistill(draft, vocab.ids if vocab is not None else None), len(train), loss, evaluate,
                draw_step, onpolicy_rng)
    trained, state_dict, metrics = train_steps(training, task)
    if main:
        with atomic_dir(work / "checkpoint", "checkpoint") as tmp:
            save_draft(trained, target.tokenizer, tmp, state_dict=state_dict, draft_vocab=draft_vocab)
        train_s = time.perf_counter() - t_start
        metrics.update(teacher="offline" if offline else "online", train_conversations=len(train),
                       heldout_conversations=len(heldout), skipped_records=skipped, wall_time_s=train_s,
                       draft_vocab_size=len(draft_vocab) if draft_vocab is not None else vocab_size,
                       draft_vocab_heldout_coverage=coverage)
        finish(training, metrics)

        def change(name: str) -> str:
            start, end = metrics.get(f"{name}_start"), metrics.get(f"{name}_end")
            return f"{start:.3f} -> {end:.3f}" if start is not None and end is not None else "n/a"

        print(f"distill: {dc.max_steps} steps in {train_s / 60:.1f} min, final loss {metrics['final_loss']:.4f}, "
              f"held-out expected acceptance {change('heldout_alpha')}, top-1 agreement {change('heldout_top1')} "
              f"-> {out / 'checkpoint'}")
    accelerator.wait_for_everyone()
    return out
