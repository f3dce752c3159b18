"""The training loop the distill and heads stages share: accelerate (processes, DeepSpeed ZeRO,
fp32 or bf16), AdamW with warm-up and cosine decay, gradient accumulation and clipping,
held-out evaluation, resumable checkpoints, the NaN stop, metrics.jsonl, tracker and progress bar.

A stage starts with `start_training`, hands `train_steps` a `Task` (its model, how a micro-batch
becomes a loss, how the held-out data is scored), saves what it returns, and ends with `finish`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from pipeline.config import Config, TrainConfig
from pipeline.distributed import resolve_precision
from pipeline.errors import PipelineError
from pipeline.files import atomic_dir, atomic_write_json, atomic_write_text, own_dir, remove
from pipeline.models import Target, load_target
from pipeline.runs import (
    MANIFEST, Claim, claim_stage, complete_claim, consumed, find_claim, hash_tree, read_manifest, run_dir,
    stage_dir, write_manifest,
)
from pipeline.tracking import Tracker, start_tracker
from pipeline.train.data import global_batch_indices, micro_batches

log = logging.getLogger(__name__)
CONF_DEEPSPEED = Path(__file__).resolve().parents[2] / "conf" / "deepspeed"


def make_accelerator(tc: TrainConfig):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    cpu = not torch.cuda.is_available()
    plugin = None
    if tc.deepspeed:
        path = Path(tc.deepspeed) if tc.deepspeed.endswith(".json") else CONF_DEEPSPEED / f"{tc.deepspeed}.json"
        if not path.is_file():
            choices = ", ".join(sorted(p.stem for p in CONF_DEEPSPEED.glob("*.json")))
            raise PipelineError(f"no DeepSpeed config {path}; choose one of {choices} or give a .json path")
        plugin = DeepSpeedPlugin(hf_ds_config=str(path), gradient_accumulation_steps=tc.grad_accum,
                                 gradient_clipping=tc.max_grad_norm)
    # On CPUs the process group must be gloo; Accelerator(cpu=True) would drop DeepSpeed for DDP.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if cpu and launched else []
    precision = resolve_precision(tc.precision, "cpu" if cpu else "cuda")
    if tc.precision == "auto":
        log.info("precision auto -> %s (%s bf16 on this %s)", precision,
                 "native" if precision == "bf16" else "no native", "CPU" if cpu else "GPU")
    mixed = "bf16" if precision == "bf16" else "no"
    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision") != mixed:
        # One process may train twice (stage=all: distill, then heads) at other precisions; the
        # state accelerate keeps per process would refuse the second (the process group stays).
        AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=cpu and plugin is None, mixed_precision=mixed,
                              gradient_accumulation_steps=tc.grad_accum, deepspeed_plugin=plugin,
                              kwargs_handlers=handlers)
    if plugin is not None:  # we feed batches ourselves, so DeepSpeed learns their size here
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = tc.batch_size
        ds["train_batch_size"] = tc.batch_size * tc.grad_accum * accelerator.num_processes
    return accelerator


def lr_lambda(tc: TrainConfig):
    def factor(step: int) -> float:
        if step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps))
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def save_state(folder: Path, accelerator, model, optimizer, scheduler, step: int,
               rng: Optional[torch.Generator], plan: str, start_stats: dict) -> None:
    """A resumable checkpoint written atomically: trainable weights (safetensors), optimizer
    (tensors only, read back with weights_only=True), scheduler, step and RNG states (the
    stage's own sampler's as `onpolicy_rng`, for a stage that has one)."""
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
                onpolicy_rng=rng.get_state().tolist() if rng is not None else None))
        for stale in folder.glob("deepspeed-*"):
            if stale.name != deepspeed_dir:
                remove(stale)
    accelerator.wait_for_everyone()


def load_state(folder: Path, accelerator, model, optimizer, scheduler, rng: Optional[torch.Generator] = None) -> dict:
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
    if rng is not None:
        rng.set_state(torch.tensor(trainer["onpolicy_rng"], dtype=torch.uint8))
    return trainer


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop the metrics logged after the checkpoint a run resumes from: those steps run again."""
    lines = path.read_text().splitlines() if path.is_file() else []
    atomic_write_text(path, "".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))


@dataclass
class Training:
    """A training stage's run, from the claim of its folder to its manifest."""

    cfg: Config
    tc: TrainConfig
    stage: str
    """distill or heads: its config node, its metrics' prefix, the name in its messages."""
    name: str
    """As the progress bar and printed lines say it: distill, heads (eagle)."""
    accelerator: Any
    target: Target
    fingerprint: str
    generate_dir: Path
    gen_manifest: dict
    plan: str
    """The hash of what decides the trained weights; a checkpoint of another plan is never resumed."""
    claim: Claim
    resuming: bool
    """claim.folder holds a checkpoint of this plan, and training continues from it."""
    tracker: Tracker  # logs nothing off the main process

    @property
    def work(self) -> Path:
        return self.claim.folder

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def start_training(cfg: Config, tc: TrainConfig, stage: str, out: Path, plan_key: Callable[[Config, dict], str],
                   kind: Optional[str] = None) -> Optional[Training]:
    """What every training stage starts with: the finished generate stage, the accelerator, the
    seed, the target (checked to be the one that generated), the plan (`plan_key(cfg, generate
    manifest)`), the folder the run works in (runs.claim_stage, decided by the main process) and
    the tracker; `kind` (heads: medusa, eagle, early_exit) joins the stage's name there and on the
    progress bar. None when `out` already holds the finished result of this plan."""
    from accelerate.utils import set_seed

    generate_dir = stage_dir(cfg.runs_dir, cfg.run, "generate")
    gen_manifest = read_manifest(generate_dir, "generate", cfg.run)
    accelerator = make_accelerator(tc)
    main = accelerator.is_main_process
    set_seed(cfg.seed)
    target = load_target(**{**dataclasses.asdict(cfg.target), "device": str(accelerator.device)})
    fingerprint = target.fingerprint()
    if gen_manifest.get("target_fingerprint") not in (None, fingerprint):
        raise PipelineError(f"{generate_dir} was generated by another target (fingerprint "
                            f"{gen_manifest['target_fingerprint'][:12]}…, this one {fingerprint[:12]}…)")
    plan = plan_key(cfg, gen_manifest)
    if main:
        claim = claim_stage(out, stage, plan, overwrite=tc.overwrite, restart=not tc.resume,
                            started=lambda folder: (folder / "state" / "last" / "trainer.json").is_file())
    accelerator.wait_for_everyone()
    if not main:
        claim = find_claim(out, stage, plan)
    if claim.done:
        if main:
            print(f"{stage}: already complete with this config in {out}; nothing to do "
                  f"(another config needs {stage}.overwrite=true or another run=<name>)")
        return None
    if claim.aside:
        log.info("%s: %s stays as it is until this run (in %s) is complete", stage, out, claim.folder)
    trainer_json = claim.folder / "state" / "last" / "trainer.json"
    resuming = tc.resume and trainer_json.is_file()
    if resuming and json.loads(trainer_json.read_text()).get("plan") != plan:
        raise PipelineError(f"{claim.folder} holds a {stage} run with another config or data; "
                            f"add {stage}.overwrite=true to start over (or use another run=)")
    tracker = start_tracker(cfg.logger.kind, run_name=cfg.run, stage=f"{stage}-{kind}" if kind else stage,
                            config=dataclasses.asdict(cfg), log_dir=run_dir(cfg.runs_dir, cfg.run),
                            project=cfg.logger.project, entity=cfg.logger.entity, mode=cfg.logger.mode,
                            is_main_process=main)
    return Training(cfg, tc, stage, f"{stage} ({kind})" if kind else stage, accelerator, target, fingerprint,
                    generate_dir, gen_manifest, plan, claim, resuming, tracker)


@dataclass
class Task:
    """What a stage trains, as the loop sees it."""

    model: torch.nn.Module
    """Behind one forward, so DDP and DeepSpeed see every call; its `.draft` is trained and saved."""
    num_examples: int
    """Each global step draws indices of the training examples (train.data.global_batch_indices)."""
    loss: Callable[[torch.nn.Module, list[int], dict], tuple[torch.Tensor, int]]
    """(prepared model, one micro-batch's example indices, what draw_step drew) -> (loss, tokens in it)."""
    evaluate: Callable[[torch.nn.Module], dict]
    """prepared model (in eval mode, without grad) -> held-out statistics, `heldout_*` keys."""
    draw_step: Optional[Callable[[], dict]] = None
    """What is decided once per step (distill: on-policy or not), handed to `loss` and logged."""
    rng: Optional[torch.Generator] = None
    """The stage's own sampler (distill's on-policy one), restored on resume."""
    select: Optional[str] = None
    """A key of `evaluate`'s statistics, higher better (heads: the held-out τ): of the weights
    evaluated every eval_every steps, those with the best value are the result, not the last."""


def prefixed(stage: str, metrics: dict) -> dict:
    return {f"{stage}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None}


def train_steps(training: Training, task: Task) -> tuple[torch.nn.Module, Optional[dict], dict]:
    """The optimizer steps from the checkpoint the run resumes (or the first) to max_steps. Returns
    the trained module (the model's `.draft`); under DeepSpeed its full state dict, gathered on the
    main process (else None); and the metrics: final_loss, steps, trainable_parameters, processes,
    distributed, the held-out statistics before the first step (`<key>_start`, from the checkpoint
    when resumed) and after the last (`<key>_end`)."""
    accelerator, tc, stage, work, main = (training.accelerator, training.tc, training.stage, training.work,
                                          training.main)
    tracker = training.tracker
    trainable = [p for p in task.model.parameters() if p.requires_grad]
    num_trainable = sum(p.numel() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=tc.lr, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc))
    model, optimizer = accelerator.prepare(task.model, optimizer)

    start_step, start_stats = 0, {}
    if training.resuming:
        trainer = load_state(work / "state", accelerator, model, optimizer, scheduler, task.rng)
        start_step, start_stats = int(trainer["step"]), trainer.get("start_stats") or {}
        log.info("%s: resuming after step %d from %s", stage, start_step, work / "state")
        if main:
            keep_metrics_until(work / "metrics.jsonl", start_step)
    elif main:
        remove(work / "metrics.jsonl")

    world, rank = accelerator.num_processes, accelerator.process_index
    global_batch = tc.batch_size * world * tc.grad_accum
    if main:
        log.info("%s: %s trainable parameters, global batch %d x %d steps, %d process(es)%s", stage,
                 f"{num_trainable:,}", global_batch, tc.max_steps, world,
                 f", DeepSpeed {tc.deepspeed}" if tc.deepspeed else "")

    def evaluate() -> dict:
        model.eval()
        with torch.no_grad():
            stats = task.evaluate(model)
        model.train()
        return stats

    if start_step == 0:
        start_stats = evaluate()
    best = Best(work / "best", task.select if accelerator.distributed_type.name != "DEEPSPEED" else None)
    if task.select and best.key is None:
        log.warning("%s: under DeepSpeed the last step's weights are kept (no choice by %s)", stage, task.select)
    if main and start_step == 0:  # a resumed run finds the kept weights in best.folder
        best.consider(0, start_stats, accelerator.unwrap_model(model).draft)
    tokens_seen, t_loop = 0, time.perf_counter()
    bar = tqdm(total=tc.max_steps, initial=start_step, desc=training.name, unit="step", disable=not main,
               dynamic_ncols=True)
    last_loss, record = float("nan"), {}
    for step in range(start_step, tc.max_steps):
        indices = global_batch_indices(task.num_examples, step, global_batch, training.cfg.seed)
        drawn = task.draw_step() if task.draw_step is not None else {}
        losses = []
        for micro in micro_batches(indices, tc.batch_size, rank, world):
            with accelerator.accumulate(model):
                loss, tokens = task.loss(model, micro, drawn)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable if not tc.deepspeed else model.parameters(), tc.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
            tokens_seen += tokens
        scheduler.step()
        step_loss = accelerator.gather(torch.stack(losses).mean()[None]).mean().item()
        if not math.isfinite(step_loss):
            raise PipelineError(f"{stage}: the loss is {step_loss} at step {step + 1}; lower {stage}.lr "
                                f"(now {tc.lr}) or check the data; the last good checkpoint is in {work / 'state'}")
        last_loss = step_loss
        elapsed = time.perf_counter() - t_loop
        record = dict(step=step + 1, loss=step_loss, lr=scheduler.get_last_lr()[0],
                      tokens_per_s=tokens_seen * world / elapsed, train_s=round(elapsed, 2), **drawn)
        if (step + 1) % tc.eval_every == 0 or step + 1 == tc.max_steps:
            record.update(evaluate())
            if main:
                best.consider(step + 1, record, accelerator.unwrap_model(model).draft)
                bar.write(f"{training.name} step {step + 1}: {heldout_line(record)}")
        if main:
            with open(work / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            tracker.log(prefixed(stage, record), step=step + 1)
            bar.set_postfix(loss=f"{step_loss:.4f}", **{name: f"{record[key]:.3f}" for name, key in
                                                        (("alpha", "heldout_alpha"), ("top1", "heldout_top1"),
                                                         ("tau", task.select)) if key and record.get(key) is not None})
            bar.update(1)
        if (step + 1) % tc.save_every == 0 and step + 1 < tc.max_steps:
            save_state(work / "state", accelerator, model, optimizer, scheduler, step + 1, task.rng, training.plan,
                       start_stats)
    bar.close()

    end_stats = ({k: v for k, v in record.items() if k.startswith("heldout")} if start_step < tc.max_steps
                 else evaluate())
    chosen = {}
    if best.key and main:
        chosen = best.restore(accelerator.unwrap_model(model).draft, tc.max_steps, end_stats)
        end_stats = chosen.pop("stats")
    accelerator.wait_for_everyone()
    state_dict = None
    if accelerator.distributed_type.name == "DEEPSPEED":
        state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards, full tensors on the main process
        state_dict = {k.removeprefix("draft."): v for k, v in state.items()} if main else None
    metrics = dict(final_loss=last_loss, steps=tc.max_steps, trainable_parameters=num_trainable, processes=world,
                   distributed=accelerator.distributed_type.name, **chosen,
                   **{f"{k}_start": v for k, v in start_stats.items()},
                   **{f"{k}_end": v for k, v in end_stats.items()})
    return accelerator.unwrap_model(model).draft, state_dict, metrics


def heldout_line(stats: dict) -> str:
    """The held-out statistics of an evaluation on one line: lists per draft position, numbers."""
    def shown(value) -> str:
        if isinstance(value, list):
            return "[" + ", ".join("-" if v is None else f"{v:.3f}" for v in value) + "]"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    return ", ".join(f"{k.removeprefix('heldout_')} {shown(v)}" for k, v in stats.items()
                     if k.startswith("heldout") and v is not None) or "no held-out data"


class Best:
    """The weights with the best held-out `key` so far (Task.select), kept in `folder` (the
    trainable tensors and best.json: the step and its statistics), so a resumed run still
    knows them. Only the main process calls it; without a key it keeps nothing."""

    def __init__(self, folder: Path, key: Optional[str]) -> None:
        self.folder, self.key = folder, key

    def read(self) -> Optional[dict]:
        try:
            return json.loads((self.folder / "best.json").read_text())
        except (OSError, ValueError):
            return None

    def consider(self, step: int, stats: dict, draft: torch.nn.Module) -> None:
        """Keep `draft`'s weights if its statistics at `step` beat the kept ones (at step 0, a
        fresh run, whatever an earlier one kept is replaced)."""
        from safetensors.torch import save_file

        if self.key is None or stats.get(self.key) is None:
            return
        kept = self.read() if step > 0 else None
        if kept is not None and kept["stats"][self.key] >= stats[self.key]:
            return
        with atomic_dir(self.folder, "checkpoint") as tmp:
            save_file({n: p.detach().contiguous().cpu() for n, p in draft.named_parameters() if p.requires_grad},
                      str(tmp / "trainable.safetensors"))
            atomic_write_json(tmp / "best.json", dict(step=step, stats={k: v for k, v in stats.items()
                                                                        if k.startswith("heldout")}))

    def restore(self, draft: torch.nn.Module, last_step: int, last_stats: dict) -> dict:
        """Load the kept weights into `draft` where they beat the last step's, and say which were
        chosen: selected_step, selected_by, last_step_<key>, and `stats` (the chosen weights')."""
        from safetensors.torch import load_file

        kept = self.read()
        chosen = dict(selected_by=self.key, selected_step=last_step, stats=last_stats,
                      **{f"last_step_{self.key}": last_stats.get(self.key)})
        if kept is not None and kept["step"] != last_step and (last_stats.get(self.key) is None or
                                                               kept["stats"][self.key] > last_stats[self.key]):
            params = dict(draft.named_parameters())
            with torch.no_grad():
                for name, value in load_file(str(self.folder / "trainable.safetensors")).items():
                    params[name].copy_(value)
            chosen.update(selected_step=kept["step"], stats=kept["stats"])
            log.info("keeping the weights of step %d (%s %.3f; the last step's %s)", kept["step"], self.key,
                     kept["stats"][self.key], last_stats.get(self.key))
        remove(self.folder)
        return chosen


def finish(training: Training, metrics: dict) -> None:
    """The main process's last steps once the stage's result is in its folder: the checkpoint
    removed, the metrics logged, the manifest written, the claim completed."""
    work = training.work
    remove(work / "state")
    training.tracker.log(prefixed(training.stage, metrics))
    training.tracker.finish()
    write_manifest(work, stage=training.stage, config=dataclasses.asdict(training.cfg),
                   target_fingerprint=training.fingerprint,
                   outputs={k: v for k, v in hash_tree(work).items() if k != MANIFEST and not k.startswith("state")},
                   wall_time_s=metrics["wall_time_s"], inputs={"generate": consumed(training.generate_dir)},
                   metrics=metrics, plan=training.plan)
    complete_claim(training.claim)
