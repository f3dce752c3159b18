"""The heads stage: train Medusa heads, an EAGLE head or an early-exit adapter on the frozen
target's own hidden states (online: the target runs in the loop, no grad).

Input: `runs/<run>/generate/dataset`. Output (`runs/<run>/heads/<kind>/`):
  heads.safetensors    the trained weights and the draft vocabulary (draft_to_target)
  heads_config.json    kind and settings; load_heads rebuilds the rest from the target
  initial/             the same heads before training (the baseline)
  state/               the last resumable checkpoint (deleted when the run finishes)
  metrics.jsonl        loss, learning rate, held-out α and top-1 agreement per logged step
  plan.json            the hash of what decides the weights
  manifest.json        written last, with the sha256 of the generate manifest it trained on

Processes, DeepSpeed, resume, overwrite (a finished stage stays until its replacement is
complete), NaN checks and logging work as in the distill stage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from pipeline.config import Config
from pipeline.distill.data import collate, global_batch_indices, load_examples, micro_batches, split_heldout
from pipeline.distill.draft import frequent_tokens
from pipeline.distill.stage import (
    answer_tokens, claim_training, keep_metrics_until, load_state, lr_lambda, save_state, start_training,
)
from pipeline.distributed import native_bf16
from pipeline.errors import PipelineError
from pipeline.heads.models import build_heads, feature_indices, own_state, save_heads
from pipeline.heads.cache import FeatureCache, find_cache
from pipeline.heads.train import HeadsForTraining, Terms, target_layers, target_view, view_from_hidden
from pipeline.files import atomic_dir, remove, rename
from pipeline.runs import MANIFEST, complete_claim, consumed, hash_tree, stage_dir, write_manifest
from pipeline.tracking import start_tracker

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


def heads_dir(cfg: Config, kind: Optional[str] = None) -> Path:
    return stage_dir(cfg.runs_dir, cfg.run, STAGE) / (kind or cfg.heads.kind)


def plan_key(cfg: Config, gen_manifest: dict) -> str:
    settings = dataclasses.asdict(cfg.heads)
    for free in ("resume", "overwrite", "eval_every", "save_every", "max_eval_sequences", "cache_shard_size"):
        settings.pop(free)
    key = dict(heads=settings, seed=cfg.seed, data=gen_manifest.get("outputs"),
               target=gen_manifest.get("target_fingerprint"))
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


class Tally:
    """Sums of α and top-1 agreement per draft position."""

    def __init__(self) -> None:
        self.alpha: list[float] = []
        self.top1: list[float] = []
        self.count: list[int] = []

    def add(self, terms: Terms) -> None:
        for i, (alpha, top1) in enumerate(zip(terms.alpha, terms.top1)):
            if i == len(self.count):
                self.alpha.append(0.0), self.top1.append(0.0), self.count.append(0)
            self.alpha[i] += float(alpha.sum())
            self.top1[i] += float(top1.sum())
            self.count[i] += alpha.numel()

    def means(self) -> dict:
        alpha = [a / n if n else None for a, n in zip(self.alpha, self.count)]
        top1 = [a / n if n else None for a, n in zip(self.top1, self.count)]
        return dict(heldout_alpha=alpha[0] if alpha else None, heldout_top1=top1[0] if top1 else None,
                    heldout_alpha_by_position=alpha, heldout_top1_by_position=top1)


def run(cfg: Config) -> Path:
    t_start = time.perf_counter()
    hc = cfg.heads
    out = heads_dir(cfg)
    generate_dir, gen_manifest, accelerator, target = start_training(cfg, hc)
    main, fingerprint = accelerator.is_main_process, target.fingerprint()
    plan = plan_key(cfg, gen_manifest)
    claim = claim_training(accelerator, out, STAGE, plan, hc)
    if claim is None:
        return out
    work = claim.folder
    if hc.target_bf16 is None:  # null: bf16 only where the device computes it natively
        hc = dataclasses.replace(hc, target_bf16=native_bf16(accelerator.device.type))
        log.info("heads.target_bf16 null -> %s", hc.target_bf16)
    examples, skipped = load_examples(generate_dir / "dataset", hc.max_length)
    train, heldout = split_heldout(examples, hc.eval_fraction)
    heldout = heldout[: hc.max_eval_sequences]
    if not train:
        raise PipelineError(f"no conversation of {generate_dir} is left for training after holding "
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
    model = HeadsForTraining(heads.train(), target_model, hc.loss, hc.medusa_decay, hc.ttt_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    num_trainable = sum(p.numel() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=hc.lr, weight_decay=hc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(hc))
    model, optimizer = accelerator.prepare(model, optimizer)

    start_step = 0
    trainer_json = work / "state" / "last" / "trainer.json"
    if hc.resume and trainer_json.is_file():
        if json.loads(trainer_json.read_text()).get("plan") != plan:
            raise PipelineError(f"{work} holds a heads run with another config or data; "
                                "add heads.overwrite=true to start over (or use another run=)")
        start_step = int(load_state(work / "state", accelerator, model, optimizer, scheduler)["step"])
        log.info("heads: resuming after step %d from %s", start_step, work / "state")
        if main:
            keep_metrics_until(work / "metrics.jsonl", start_step)
    elif main:
        remove(work / "metrics.jsonl")

    world, rank = accelerator.num_processes, accelerator.process_index
    global_batch = hc.batch_size * world * hc.grad_accum
    layers, vocab_ids = heads.feature_layers, heads.draft_to_target
    if main:
        log.info("heads: %s, %d train / %d held-out conversations (%d skipped), loss %s, %s trainable "
                 "parameters, draft vocabulary %d (held-out coverage %s), global batch %d x %d steps, "
                 "%d process(es)", hc.kind, len(train), len(heldout), sum(skipped.values()), hc.loss,
                 f"{num_trainable:,}", len(draft_vocab), f"{coverage:.3f}" if coverage is not None else "n/a",
                 global_batch, hc.max_steps, world)
    tracker = start_tracker(cfg.logger.kind, run_name=cfg.run, stage=f"{STAGE}-{hc.kind}",
                            config=dataclasses.asdict(cfg), log_dir=out.parent.parent, project=cfg.logger.project,
                            entity=cfg.logger.entity, mode=cfg.logger.mode) if main else None

    @torch.no_grad()
    def evaluate() -> dict:
        if not heldout:
            return {}
        model.eval()
        tally = Tally()
        for start in range(0, len(heldout), hc.batch_size):
            batch = collate(heldout[start : start + hc.batch_size], pad_id, False).to(accelerator.device)
            tally.add(model(target_view(target_model, batch, layers, vocab_ids), batch))  # fp32: as eval sees it
        model.train()
        return tally.means()

    cache = None
    if hc.features == "offline":
        layers_needed = target_layers(target_model, layers)
        data_key = json.dumps(gen_manifest.get("outputs"), sort_keys=True) + f"/heldout={hc.eval_fraction}"
        folder, cached = find_cache(stage_dir(cfg.runs_dir, cfg.run, STAGE), fingerprint, layers_needed, data_key,
                                    hc.max_length, hc.target_bf16)
        if cached != layers_needed:
            log.info("heads: layers %s read from the feature cache of layers %s (%s)", layers_needed, cached, folder.name)
        cache = FeatureCache(folder, cached, target_model.config.hidden_size, hc.cache_shard_size)
        if main:
            cache.build(target_model, train, pad_id, hc.batch_size, hc.target_bf16)
        accelerator.wait_for_everyone()

    start_eval = evaluate() if start_step == 0 else {}
    bar = tqdm(total=hc.max_steps, initial=start_step, desc=f"heads ({hc.kind})", unit="step", disable=not main,
               dynamic_ncols=True)
    tokens_seen, t_loop, last_loss, record = 0, time.perf_counter(), float("nan"), {}
    for step in range(start_step, hc.max_steps):
        indices = global_batch_indices(len(train), step, global_batch, cfg.seed)
        losses = []
        for micro in micro_batches(indices, hc.batch_size, rank, world):
            batch = collate([train[i] for i in micro], pad_id, False).to(accelerator.device)
            if cache is not None:
                view = view_from_hidden(target_model, cache.hidden(micro, batch), batch, vocab_ids, hc.target_bf16)
            else:
                view = target_view(target_model, batch, layers, vocab_ids, hc.target_bf16)
            with accelerator.accumulate(model):
                loss = model(view, batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable if not hc.deepspeed else model.parameters(), hc.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
            tokens_seen += int(batch.attention_mask.sum())
        scheduler.step()
        step_loss = accelerator.gather(torch.stack(losses).mean()[None]).mean().item()
        if not math.isfinite(step_loss):
            raise PipelineError(f"heads: the loss is {step_loss} at step {step + 1}; lower heads.lr "
                                f"(now {hc.lr}) or check the data; the last good checkpoint is in {work / 'state'}")
        last_loss = step_loss
        record = dict(step=step + 1, loss=step_loss, lr=scheduler.get_last_lr()[0],
                      tokens_per_s=tokens_seen * world / (time.perf_counter() - t_loop))
        if (step + 1) % hc.eval_every == 0 or step + 1 == hc.max_steps:
            record.update(evaluate())
        if main:
            with open(work / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            tracker.log({f"heads/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and v is not None},
                        step=step + 1)
            postfix = dict(loss=f"{step_loss:.4f}")
            if record.get("heldout_top1") is not None:
                postfix.update(alpha=f"{record['heldout_alpha']:.3f}", top1=f"{record['heldout_top1']:.3f}")
            bar.set_postfix(**postfix)
            bar.update(1)
        if (step + 1) % hc.save_every == 0 and step + 1 < hc.max_steps:
            save_state(work / "state", accelerator, model, optimizer, scheduler, step + 1, None, plan, None)
    bar.close()

    end_eval = {k: v for k, v in record.items() if k.startswith("heldout")} if start_step < hc.max_steps else evaluate()
    accelerator.wait_for_everyone()
    final = None
    if accelerator.distributed_type.name == "DEEPSPEED":
        state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards on the main process
        final = {k.removeprefix("draft."): v for k, v in state.items()} if main else None
    unwrapped = accelerator.unwrap_model(model).draft
    if main:
        train_s = time.perf_counter() - t_start
        metrics = dict(kind=hc.kind, features=hc.features, final_loss=last_loss, steps=hc.max_steps, trainable_parameters=num_trainable,
                       processes=world, distributed=accelerator.distributed_type.name,
                       train_conversations=len(train), heldout_conversations=len(heldout), skipped_records=skipped,
                       wall_time_s=train_s, draft_vocab_size=len(draft_vocab), draft_vocab_heldout_coverage=coverage,
                       **{f"{k}_start": v for k, v in start_eval.items()}, **{f"{k}_end": v for k, v in end_eval.items()})
        state = {k: v for k, v in final.items() if k in own_state(unwrapped)} if final is not None else None
        with atomic_dir(work / "final", "checkpoint") as tmp:
            save_heads(unwrapped, tmp, extra=dict(target=target.name, target_fingerprint=fingerprint), state=state)
        for name in ("heads.safetensors", "heads_config.json"):
            rename(work / "final" / name, work / name)
        remove(work / "final")
        remove(work / "state")
        tracker.log({f"heads/{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None})
        tracker.finish()
        write_manifest(work, stage=STAGE, config=dataclasses.asdict(cfg), target_fingerprint=fingerprint,
                       outputs={k: v for k, v in hash_tree(work).items() if k != MANIFEST and not k.startswith("state")},
                       wall_time_s=train_s, inputs={"generate": consumed(generate_dir)}, metrics=metrics, plan=plan)
        complete_claim(claim)
        alpha = lambda d: f"{d['heldout_top1']:.3f}" if d.get("heldout_top1") is not None else "n/a"
        print(f"heads ({hc.kind}): {hc.max_steps} steps in {train_s / 60:.1f} min, final loss {last_loss:.4f}, "
              f"held-out top-1 agreement at draft position 1 {alpha(start_eval)} -> {alpha(end_eval)} -> {out}")
    accelerator.wait_for_everyone()
    return out
