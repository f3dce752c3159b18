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
CPUs, NCCL on GPUs); `distill.deepspeed=zero2|zero3` for DeepSpeed ZeRO.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pipeline.config import Config, DistillConfig
from pipeline.distill.data import Batch, Example, collate, global_batch_indices, load_examples, micro_batches, split_heldout
from pipeline.distill.draft import (
    add_lora, check_vocabulary, frequent_tokens, new_draft, pretrained_draft, save_draft,
)
from pipeline.distill.losses import DraftVocab, Teacher, distill_loss, expected_acceptance, top1_agreement
from pipeline.distributed import resolve_precision
from pipeline.errors import PipelineError
from pipeline.models import load_target
from pipeline.files import atomic_dir, atomic_write_json, atomic_write_text, own_dir, remove
from pipeline.runs import (
    MANIFEST, claim_stage, complete_claim, consumed, find_claim, hash_tree, read_manifest, stage_dir,
    write_manifest,
)
from pipeline.tracking import start_tracker

log = logging.getLogger(__name__)
STAGE = "distill"
CONF_DEEPSPEED = Path(__file__).resolve().parent.parent.parent / "conf" / "deepspeed"


def selected_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    rows: torch.Tensor, cols: torch.Tensor, vocab: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The model's logits at the batch's learned positions only. [N, V], or [N, len(vocab)]
    over the LM-head rows `vocab` only.

    The LM head (49k x 576 for the embedded target) runs on those N positions instead of
    every token, which halves its cost on chat data where prompts are half the tokens; a draft
    vocabulary of 8192 tokens cuts the rest by 6x.
    """
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
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

    def forward(self, input_ids, attention_mask, rows, cols) -> torch.Tensor:
        return selected_logits(self.draft, input_ids, attention_mask, rows, cols, self.vocab)


def answer_tokens(examples: list[Example]) -> list[int]:
    """The target tokens the draft learns to predict (each learned position's next token)."""
    return [ex.input_ids[t + 1] for ex in examples for t in ex.positions]


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


def make_accelerator(dc: DistillConfig):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    cpu = not torch.cuda.is_available()
    plugin = None
    if dc.deepspeed:
        path = Path(dc.deepspeed) if dc.deepspeed.endswith(".json") else CONF_DEEPSPEED / f"{dc.deepspeed}.json"
        if not path.is_file():
            choices = ", ".join(sorted(p.stem for p in CONF_DEEPSPEED.glob("*.json")))
            raise PipelineError(f"no DeepSpeed config {path}; choose one of {choices} or give a .json path")
        plugin = DeepSpeedPlugin(hf_ds_config=str(path), gradient_accumulation_steps=dc.grad_accum,
                                 gradient_clipping=dc.max_grad_norm)
    # On CPUs the process group must be gloo; Accelerator(cpu=True) would drop DeepSpeed for DDP.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if cpu and launched else []
    precision = resolve_precision(dc.precision, "cpu" if cpu else "cuda")
    if dc.precision == "auto":
        log.info("precision auto -> %s (%s bf16 on this %s)", precision,
                 "native" if precision == "bf16" else "no native", "CPU" if cpu else "GPU")
    accelerator = Accelerator(cpu=cpu and plugin is None, mixed_precision="bf16" if precision == "bf16" else "no",
                              gradient_accumulation_steps=dc.grad_accum, deepspeed_plugin=plugin,
                              kwargs_handlers=handlers)
    if plugin is not None:  # we feed batches ourselves, so DeepSpeed learns their size here
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = dc.batch_size
        ds["train_batch_size"] = dc.batch_size * dc.grad_accum * accelerator.num_processes
    return accelerator


def lr_lambda(dc: DistillConfig):
    def factor(step: int) -> float:
        if step < dc.warmup_steps:
            return (step + 1) / dc.warmup_steps
        progress = min(1.0, (step - dc.warmup_steps) / max(1, dc.max_steps - dc.warmup_steps))
        return dc.min_lr_ratio + (1 - dc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


@torch.no_grad()
def teacher_for(target_model: Optional[torch.nn.Module], batch: Batch) -> Teacher:
    if batch.teacher is not None:
        return batch.teacher
    return Teacher(selected_logits(target_model, batch.input_ids, batch.attention_mask, batch.rows, batch.cols).float())


@torch.no_grad()
def heldout_acceptance(model, target_model, examples: list[Example], pad_id: int, offline: bool,
                       batch_size: int, device, vocab: Optional[DraftVocab] = None) -> tuple[float, float]:
    """Mean expected acceptance α = 1 − TV(p, q) and top-1 agreement over the held-out positions."""
    alpha_sum, top1_sum, count = 0.0, 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start : start + batch_size], pad_id, offline).to(device)
        logits = model(batch.input_ids, batch.attention_mask, batch.rows, batch.cols)
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


def save_state(folder: Path, accelerator, model, optimizer, scheduler, step: int,
               onpolicy_rng: Optional[torch.Generator], plan: str, start_stats: Optional[dict]) -> None:
    """A resumable checkpoint written atomically: trainable weights (safetensors), optimizer
    (tensors only, read back with weights_only=True), scheduler, step and RNG states (the
    on-policy sampler's, for a stage that has one)."""
    from safetensors.torch import save_file

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        own_dir(folder, "state")
    accelerator.wait_for_everyone()
    deepspeed_dir = f"deepspeed-{step}"
    if accelerator.distributed_type.name == "DEEPSPEED":
        # DeepSpeed writes its shards from every rank; trainer.json, replaced atomically
        # afterwards, names the complete one, so a kill in between resumes from the older.
        accelerator.save_state(str(folder / deepspeed_dir))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_dir(folder / "last", "state") as tmp:
            if accelerator.distributed_type.name != "DEEPSPEED":
                draft = accelerator.unwrap_model(model).draft
                trainable = {n: p.detach().contiguous().cpu() for n, p in draft.named_parameters() if p.requires_grad}
                save_file(trainable, str(tmp / "trainable.safetensors"))
                torch.save(optimizer.optimizer.state_dict() if hasattr(optimizer, "optimizer") else optimizer.state_dict(),
                           tmp / "optimizer.pt")
            atomic_write_json(tmp / "trainer.json", dict(
                step=step, plan=plan, start_stats=start_stats, deepspeed_dir=deepspeed_dir,
                scheduler=scheduler.state_dict(),
                torch_rng=torch.get_rng_state().tolist(),
                onpolicy_rng=onpolicy_rng.get_state().tolist() if onpolicy_rng is not None else None))
        for stale in folder.glob("deepspeed-*"):
            if stale.name != deepspeed_dir:
                remove(stale)
    accelerator.wait_for_everyone()


def load_state(folder: Path, accelerator, model, optimizer, scheduler,
               onpolicy_rng: Optional[torch.Generator] = None) -> dict:
    from safetensors.torch import load_file

    last = folder / "last"
    trainer = json.loads((last / "trainer.json").read_text())
    if accelerator.distributed_type.name == "DEEPSPEED":
        accelerator.load_state(str(folder / trainer["deepspeed_dir"]))
    else:
        draft = accelerator.unwrap_model(model).draft
        params = dict(draft.named_parameters())
        with torch.no_grad():
            for name, value in load_file(str(last / "trainable.safetensors")).items():
                params[name].copy_(value)
        state = torch.load(last / "optimizer.pt", weights_only=True, map_location="cpu")
        (optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).load_state_dict(state)
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(torch.tensor(trainer["torch_rng"], dtype=torch.uint8))
    if onpolicy_rng is not None:
        onpolicy_rng.set_state(torch.tensor(trainer["onpolicy_rng"], dtype=torch.uint8))
    return trainer


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the metrics logged after the checkpoint a run resumes from: those steps run again."""
    lines = path.read_text().splitlines() if path.is_file() else []
    atomic_write_text(path, "".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))


def start_training(cfg: Config, tc):
    """What every training stage starts with: the finished generate stage, the accelerator
    (tc: its TrainConfig), the seed, and the target, checked to be the one that generated."""
    from accelerate.utils import set_seed

    generate_dir = stage_dir(cfg.runs_dir, cfg.run, "generate")
    gen_manifest = read_manifest(generate_dir, "generate", cfg.run)
    accelerator = make_accelerator(tc)
    set_seed(cfg.seed)
    target = load_target(**{**dataclasses.asdict(cfg.target), "device": str(accelerator.device)})
    fingerprint = target.fingerprint()
    if gen_manifest.get("target_fingerprint") not in (None, fingerprint):
        raise PipelineError(f"{generate_dir} was generated by another target (fingerprint "
                            f"{gen_manifest['target_fingerprint'][:12]}…, this one {fingerprint[:12]}…)")
    return generate_dir, gen_manifest, accelerator, target


def plan_key(cfg: Config, gen_manifest: dict) -> str:
    """A hash of what decides the trained weights: draft, training settings, data, seed."""
    import hashlib

    settings = dataclasses.asdict(cfg.distill)
    for free in ("resume", "overwrite", "eval_every", "save_every", "max_eval_sequences"):
        settings.pop(free)
    key = dict(draft=dataclasses.asdict(cfg.draft), distill=settings, seed=cfg.seed,
               data=gen_manifest.get("outputs"), target=gen_manifest.get("target_fingerprint"))
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def claim_training(accelerator, out: Path, stage: str, plan: str, tc):
    """Where this training run works (runs.claim_stage, decided by the main process); None when
    `out` already holds the finished result of this plan."""
    if accelerator.is_main_process:
        claim = claim_stage(out, stage, plan, overwrite=tc.overwrite, restart=not tc.resume,
                            started=lambda folder: (folder / "state" / "last" / "trainer.json").is_file())
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        claim = find_claim(out, stage, plan)
    if claim.done:
        if accelerator.is_main_process:
            print(f"{stage}: already complete with this config in {out}; nothing to do "
                  f"(another config needs {stage}.overwrite=true or another run=<name>)")
        return None
    if claim.aside:
        log.info("%s: %s stays as it is until this run (in %s) is complete", stage, out, claim.folder)
    return claim


def run(cfg: Config) -> Path:
    t_start = time.perf_counter()
    dc = cfg.distill
    out = stage_dir(cfg.runs_dir, cfg.run, STAGE)
    generate_dir, gen_manifest, accelerator, target = start_training(cfg, dc)
    main, fingerprint = accelerator.is_main_process, target.fingerprint()
    # What decides the result: a checkpoint of another plan is never resumed.
    plan = plan_key(cfg, gen_manifest)
    claim = claim_training(accelerator, out, STAGE, plan, dc)
    if claim is None:
        return out
    work = claim.folder
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
    trainer_json = work / "state" / "last" / "trainer.json"
    resuming = dc.resume and trainer_json.is_file()
    if resuming and json.loads(trainer_json.read_text()).get("plan") != plan:
        raise PipelineError(f"{work} holds a distill run with another config or data; "
                            "add distill.overwrite=true to start over (or use another run=)")
    # The untrained baseline of this plan: written afresh unless this run resumes its own.
    if main and not (resuming and (work / "initial" / "config.json").is_file()):
        with atomic_dir(work / "initial", "checkpoint") as tmp:
            save_draft(draft, target.tokenizer, tmp, draft_vocab=draft_vocab)
    vocab = DraftVocab(draft_vocab.to(accelerator.device), vocab_size) if draft_vocab is not None else None
    model = DraftForDistill(draft, vocab.ids if vocab is not None else None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    num_trainable = sum(p.numel() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=dc.lr, weight_decay=dc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(dc))
    model, optimizer = accelerator.prepare(model, optimizer)
    onpolicy_rng = torch.Generator().manual_seed(cfg.seed + 1)

    start_step, start_stats = 0, {}
    if resuming:
        trainer = load_state(work / "state", accelerator, model, optimizer, scheduler, onpolicy_rng)
        start_step, start_stats = int(trainer["step"]), trainer.get("start_stats") or {}
        log.info("distill: resuming after step %d from %s", start_step, work / "state")
        if main:
            keep_metrics_until(work / "metrics.jsonl", start_step)
    elif main:
        remove(work / "metrics.jsonl")

    world, rank = accelerator.num_processes, accelerator.process_index
    global_batch = dc.batch_size * world * dc.grad_accum
    if main:
        log.info("distill: %d train / %d held-out conversations (%d skipped), teacher %s, loss %s, "
                 "%s trainable parameters, global batch %d x %d steps, %d process(es)%s",
                 len(train), len(heldout), sum(skipped.values()), "offline top-k" if offline else "online",
                 dc.loss, f"{num_trainable:,}", global_batch, dc.max_steps, world,
                 f", DeepSpeed {dc.deepspeed}" if dc.deepspeed else "")
    tracker = start_tracker(cfg.logger.kind, run_name=cfg.run, stage=STAGE, config=dataclasses.asdict(cfg),
                            log_dir=out.parent, project=cfg.logger.project, entity=cfg.logger.entity,
                            mode=cfg.logger.mode) if main else None

    def evaluate() -> dict:
        if not heldout:
            return dict(heldout_alpha=None, heldout_top1=None)
        model.eval()
        alpha, top1 = heldout_acceptance(model, target_model, heldout, pad_id, offline, dc.batch_size,
                                         accelerator.device, vocab)
        model.train()
        return dict(heldout_alpha=alpha, heldout_top1=top1)

    if start_step == 0:
        start_stats = evaluate()
    unwrapped = accelerator.unwrap_model(model).draft
    tokens_seen, t_loop = 0, time.perf_counter()
    bar = tqdm(total=dc.max_steps, initial=start_step, desc="distill", unit="step", disable=not main, dynamic_ncols=True)
    last_loss, record = float("nan"), {}
    for step in range(start_step, dc.max_steps):
        indices = global_batch_indices(len(train), step, global_batch, cfg.seed)
        onpolicy = dc.onpolicy_fraction > 0 and float(torch.rand((), generator=onpolicy_rng)) < dc.onpolicy_fraction
        losses = []
        for micro in micro_batches(indices, dc.batch_size, rank, world):
            chosen = [train[i] for i in micro]
            with accelerator.accumulate(model):
                if onpolicy:
                    batch = onpolicy_batch(unwrapped, chosen, dc.onpolicy_tokens, pad_id, onpolicy_rng,
                                           accelerator.device, vocab.ids if vocab is not None else None)
                else:
                    batch = collate(chosen, pad_id, offline).to(accelerator.device)
                teacher = teacher_for(target_model, batch)
                logits = model(batch.input_ids, batch.attention_mask, batch.rows, batch.cols)
                loss = draft_loss(dc, logits, teacher, batch.labels, vocab)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable if not dc.deepspeed else model.parameters(), dc.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
            tokens_seen += int(batch.attention_mask.sum())
        scheduler.step()
        step_loss = accelerator.gather(torch.stack(losses).mean()[None]).mean().item()
        if not math.isfinite(step_loss):
            raise PipelineError(f"distill: the loss is {step_loss} at step {step + 1}; lower distill.lr "
                                f"(now {dc.lr}) or check the data; the last good checkpoint is in {work / 'state'}")
        last_loss = step_loss
        record = dict(step=step + 1, loss=step_loss, lr=scheduler.get_last_lr()[0],
                      tokens_per_s=tokens_seen * world / (time.perf_counter() - t_loop), onpolicy=onpolicy)
        if (step + 1) % dc.eval_every == 0 or step + 1 == dc.max_steps:
            record.update(evaluate())
        if main:
            with open(work / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            tracker.log({f"distill/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and v is not None},
                        step=step + 1)
            bar.set_postfix(loss=f"{step_loss:.4f}", **{name: f"{record[key]:.3f}" for name, key in
                                                        (("alpha", "heldout_alpha"), ("top1", "heldout_top1"))
                                                        if record.get(key) is not None})
            bar.update(1)
        if (step + 1) % dc.save_every == 0 and step + 1 < dc.max_steps:
            save_state(work / "state", accelerator, model, optimizer, scheduler, step + 1, onpolicy_rng, plan, start_stats)
    bar.close()

    end_stats = {k: record.get(k) for k in ("heldout_alpha", "heldout_top1")} if start_step < dc.max_steps else evaluate()
    alpha_start, alpha_end = start_stats.get("heldout_alpha"), end_stats["heldout_alpha"]
    accelerator.wait_for_everyone()
    final = None
    if accelerator.distributed_type.name == "DEEPSPEED":
        state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards, full tensors on the main process
        final = {k.removeprefix("draft."): v for k, v in state.items()} if main else None
    if main:
        with atomic_dir(work / "checkpoint", "checkpoint") as tmp:
            save_draft(unwrapped, target.tokenizer, tmp, state_dict=final, draft_vocab=draft_vocab)
        remove(work / "state")
        train_s = time.perf_counter() - t_start
        metrics = dict(final_loss=last_loss, heldout_alpha_start=alpha_start, heldout_alpha_end=alpha_end,
                       heldout_top1_start=start_stats.get("heldout_top1"), heldout_top1_end=end_stats["heldout_top1"],
                       steps=dc.max_steps, trainable_parameters=num_trainable, processes=world,
                       distributed=accelerator.distributed_type.name,
                       teacher="offline" if offline else "online", train_conversations=len(train),
                       heldout_conversations=len(heldout), skipped_records=skipped, wall_time_s=train_s,
                       draft_vocab_size=len(draft_vocab) if draft_vocab is not None else vocab_size,
                       draft_vocab_heldout_coverage=coverage)
        tracker.log({f"distill/{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None})
        tracker.finish()
        write_manifest(work, stage=STAGE, config=dataclasses.asdict(cfg), target_fingerprint=fingerprint,
                       outputs={k: v for k, v in hash_tree(work).items() if k != MANIFEST and not k.startswith("state")},
                       wall_time_s=train_s, inputs={"generate": consumed(generate_dir)}, metrics=metrics, plan=plan)
        complete_claim(claim)

        def change(name: str) -> str:
            start, end = start_stats.get(name), end_stats[name]
            return f"{start:.3f} -> {end:.3f}" if start is not None and end is not None else "n/a"

        print(f"distill: {dc.max_steps} steps in {train_s / 60:.1f} min, final loss {last_loss:.4f}, held-out "
              f"expected acceptance {change('heldout_alpha')}, top-1 agreement {change('heldout_top1')} "
              f"-> {out / 'checkpoint'}")
    accelerator.wait_for_everyone()
    return out

