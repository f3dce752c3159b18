"""The generate stage: the target regenerates every assistant turn of the domain data
(or, for a share of the conversations, generate.target_answers < 1, scores the data's own
answers in one teacher-forced pass instead).

Output (`runs/<run>/generate/`):
  dataset/       datasets.save_to_disk, one row per conversation:
                   id, source, category, num_turns      metadata
                   answers                               "target" (regenerated) or "source" (scored)
                   input_ids  [T]                        the whole conversation as the target saw it
                   loss_mask  [T]                        1 on answer tokens (generated, or scored)
                   topk_ids, topk_logits  [G, k]         optional (generate.save_topk_logits=k):
                     the target's top-k raw logits (fp16) for each of the G generated tokens,
                     taken at the position that predicts it
  plan.json      what decides the content (config, data, target); a rerun resumes only under it
  manifest.json  written last; its skipped_records count every conversation left out, by reason
                 (too_long_for_max_length: the first prompt leaves no room for an answer; with
                 the server backend server_failed and malformed_answer, whose ids are in
                 server.failed_conversations), and cut_turns the later turns generate.max_length cut
While it runs, `shards/` holds finished shards (each written atomically, with dropped.json,
the counts of what was left out or cut, and failed.json, the conversations a server failed); a
killed run started again skips them, so no conversation is lost or generated twice. Under
`accelerate launch --num_processes N` rank r takes shards r, r+N, ... and rank 0 merges. With
generate.overwrite=true a finished stage of another config stays in place until the new one
(built in `.next-generate/`) is complete; generate.retry_failed=true asks a server again for a
finished stage's failed conversations the same way (retry_failed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from pipeline.config import Config, use_graphs
from pipeline.data.chat import (
    ANSWER_SENTINEL, encode, eos_token_ids, first_prompt_ids, load_chat_data, next_turn_ids,
)
from pipeline.data.server import FAILURES
from pipeline.data.sources import Conversation, check_file
from pipeline.decode.decoder import continuous_decode
from pipeline.decode.static_kv import StaticModel
from pipeline.distributed import process_state
from pipeline.errors import PipelineError
from pipeline.models import Target, load_target
from pipeline.files import atomic_dir, atomic_write_json, own_dir, remove, remove_stale_temp_dirs
from pipeline.runs import (
    PLAN, Claim, aside_dir, claim_stage, complete_claim, find_claim, hash_tree, is_finished, manifest_sha,
    read_manifest, read_plan, stage_dir, write_manifest,
)
from pipeline.tracking import start_tracker

log = logging.getLogger(__name__)
STAGE = "generate"


@torch.inference_mode()
def generate_answers(
    target: StaticModel,
    contexts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos_ids: set[int],
    batch_size: int,
    topk: int = 0,
    on_batch: Optional[Callable[[int, int], None]] = None,
) -> tuple[list[list[int]], list[Optional[tuple[torch.Tensor, torch.Tensor]]]]:
    """The target's answer to each context (ending at its end-of-turn token, if it gave one),
    longest contexts first; with topk > 0 also the target's top-k logits at each answer token
    (ids [G, k] int32, logits [G, k]), read off the logits decoding chose it from.

    Decoding is our own decoder's (pipeline.decode), which follows the decoder's contract
    (temperature and top-p only) and gives transformers' batched generate's greedy outputs,
    faster (`make bench-generate` compares them), with continuous batching: batch_size rows at
    a time, a finished row refilled from the queue.
    """
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]), reverse=True)
    answers: list[list[int]] = [[] for _ in contexts]
    scores: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None for _ in contexts]
    done = (lambda _, tokens: on_batch(1, len(tokens))) if on_batch else None
    out = continuous_decode(target, [contexts[i] for i in order], batch_size=batch_size,
                            max_new_tokens=max_new_tokens, eos_ids=eos_ids, temperature=temperature,
                            top_p=top_p, topk=topk, on_done=done)
    for row, i in enumerate(order):
        answers[i] = out.tokens[row]
        if topk:
            scores[i] = (out.topk_ids[row], out.topk_logits[row])
    return answers, scores


@torch.inference_mode()
def topk_logits(model, rows: list[dict], k: int, batch_size: int) -> None:
    """Add the target's top-k logits at every answer position to each row, in place: one
    teacher-forced forward pass per conversation. Source answers need it; regenerated ones
    keep the logits they were decoded from (regenerate's topk).
    """
    device = next(model.parameters()).device
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # right padding: positions stay 0..T-1
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # [B, S, V]
        for i, r in enumerate(batch):
            gen_pos = torch.tensor(r["loss_mask"]).nonzero().squeeze(1)  # [G] positions of generated tokens
            values, indices = logits[i, gen_pos - 1].float().topk(k, dim=-1)  # logits at t-1 predict token t
            r["topk_ids"] = indices.to(torch.int32).cpu().numpy()
            r["topk_logits"] = values.to(torch.float16).cpu().numpy()


def keeps_source_answers(conv: Conversation, target_answers: float) -> bool:
    """Whether the generate stage scores this conversation's own answers instead of regenerating
    them: a fixed function of the id (salted apart from the data split's hash)."""
    if not conv.assistant_turns or target_answers >= 1.0:
        return False
    bucket = int(hashlib.sha256(f"generate-answers:{conv.id}".encode()).hexdigest()[:8], 16) / 2**32
    return bucket >= target_answers


def planned_turns(conv: Conversation, max_turns: Optional[int], target_answers: float) -> int:
    turns = conv.assistant_turns if keeps_source_answers(conv, target_answers) else conv.user_turns
    return min(len(turns), max_turns or len(turns))


def end_of_turn_id(tokenizer, eos_ids: list[int]) -> int:
    """The token the chat template closes an assistant answer with (the target's own stop)."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ANSWER_SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    tail = encode(tokenizer, text.rpartition(ANSWER_SENTINEL)[2])
    return tail[0] if tail and tail[0] in eos_ids else eos_ids[0]


def regenerate(
    target: Target,
    conversations: list[Conversation],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    batch_size: int,
    max_length: int,
    max_turns: Optional[int],
    target_answers: float = 1.0,
    topk: int = 0,
    progress: Optional[Callable[[int, int], None]] = None,
    dropped: Optional[Counter] = None,
    static: Optional[StaticModel] = None,
) -> list[dict]:
    """Regenerate every turn of `conversations`; one row per conversation.

    Turn t of every conversation is generated in one batched call, so a later turn sees the
    target's own earlier answers. A conversation stops early when its next context plus
    max_new_tokens would exceed max_length; `dropped` counts what that leaves out (turns cut,
    and whole conversations whose first turn does not fit). Conversations chosen by keeps_source_answers keep
    the source's answers instead (cut to max_new_tokens; they end where the source's do).
    With topk > 0 a regenerated row also gets topk_ids / topk_logits [answer tokens, k] (numpy
    int32 / float16) from decoding; a source row gets them from topk_logits. `static`: the
    target for our decoder (made here by default; pass one to keep its caches across calls).
    """
    tokenizer = target.tokenizer
    static = static if static is not None else StaticModel(target.model)
    eos_list = eos_token_ids(target.generation_config, tokenizer)
    eos_ids = set(eos_list)
    keep = [keeps_source_answers(c, target_answers) for c in conversations]
    end_of_turn = end_of_turn_id(tokenizer, eos_list) if any(keep) else None
    num_turns = [planned_turns(c, max_turns, target_answers) for c in conversations]
    ids: list[list[int]] = [[] for _ in conversations]
    mask: list[list[int]] = [[] for _ in conversations]
    answers: list[list[str]] = [[] for _ in conversations]
    scores: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in conversations]
    active = [i for i, c in enumerate(conversations)]
    turn = 0
    while active:
        contexts, prompts = [], []
        for i in [i for i in active if num_turns[i] > turn]:
            conv = conversations[i]
            if turn == 0:
                new = first_prompt_ids(tokenizer, conv)
            else:
                new = next_turn_ids(tokenizer, conv, turn, answers[i], ids[i][-1], eos_ids)
            if len(ids[i]) + len(new) + max_new_tokens > max_length:
                if progress:
                    progress(num_turns[i] - turn, 0)
                if dropped is not None:
                    dropped["turns_cut_by_max_length"] += num_turns[i] - turn
                    dropped["too_long_for_max_length"] += turn == 0
                num_turns[i] = turn  # no room for this turn: the conversation ends here
                continue
            prompts.append(i)
            contexts.append(ids[i] + new)
        regen = [j for j, i in enumerate(prompts) if not keep[i]]
        generated = [[] for _ in prompts]
        answers_of_target, scores_of_target = generate_answers(
            static, [contexts[j] for j in regen], max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, eos_ids=eos_ids, batch_size=batch_size, topk=topk, on_batch=progress,
        ) if regen else ([], [])
        for j, answer, score in zip(regen, answers_of_target, scores_of_target):
            generated[j] = answer
            if topk:
                scores[prompts[j]].append(score)
        for j, i in enumerate(prompts):
            if keep[i]:
                answer = encode(tokenizer, conversations[i].assistant_turns[turn])
                generated[j] = answer[:max_new_tokens] if len(answer) >= max_new_tokens else answer + [end_of_turn]
                if progress:
                    progress(1, 0)
        for i, context, answer in zip(prompts, contexts, generated):
            mask[i] += [0] * (len(context) - len(ids[i])) + [1] * len(answer)
            ids[i] = context + answer
            answers[i].append(tokenizer.decode(answer, skip_special_tokens=True))
        turn += 1
        active = [i for i in prompts if turn < num_turns[i]]
    rows = []
    for i, c in enumerate(conversations):
        if num_turns[i] == 0:
            continue
        rows.append(dict(id=c.id, source=c.source, category=c.category, num_turns=num_turns[i],
                         answers="source" if keep[i] else "target", input_ids=ids[i], loss_mask=mask[i]))
        if topk and not keep[i]:
            rows[-1]["topk_ids"] = torch.cat([top_ids for top_ids, _ in scores[i]]).numpy()
            rows[-1]["topk_logits"] = torch.cat([top for _, top in scores[i]]).to(torch.float16).numpy()
    return rows


def features(topk: int):
    import datasets

    cols = {
        "id": datasets.Value("string"),
        "source": datasets.Value("string"),
        "category": datasets.Value("string"),
        "num_turns": datasets.Value("int32"),
        "answers": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }
    if topk:
        cols["topk_ids"] = datasets.Array2D(shape=(None, topk), dtype="int32")
        cols["topk_logits"] = datasets.Array2D(shape=(None, topk), dtype="float16")
    return datasets.Features(cols)


def plan_key(cfg: Config, fingerprint: str) -> dict:
    """What decides the shards' content: a run folder resumes only under the same plan."""
    gen = dataclasses.asdict(cfg.generate)
    for free in ("batch_size", "overwrite", "cuda_graphs", "retry_failed"):  # safe to change between restarts
        gen.pop(free)
    if gen["backend"] == "local":  # the default: keeps plans from before the option
        gen.pop("backend")
        gen.pop("server")
    else:  # where and how fast the server answers does not change what it answers
        gen["server"] = {"model": gen["server"]["model"]}
    if gen["target_answers"] == 1.0:  # the default: keeps plans (and run folders) from before the option
        gen.pop("target_answers")
    data = dataclasses.asdict(cfg.data)
    if data["per_category"] is None:  # likewise
        data.pop("per_category")
    return {
        "target_fingerprint": fingerprint,
        "target_dtype": cfg.target.dtype,
        "data": data,
        "generate": gen,
        "seed": cfg.seed,
    }


def run(cfg: Config) -> Path:
    state = process_state()
    out = stage_dir(cfg.runs_dir, cfg.run, STAGE)
    t0 = time.perf_counter()

    if cfg.data.source == "file":  # fail before the minutes a large target takes to load
        check_file(Path(cfg.data.path).expanduser())
    gen = cfg.generate
    remote = gen.backend == "server"
    target = load_target(**dataclasses.asdict(cfg.target), weights=not remote)
    fingerprint = served_fingerprint(target) if remote else target.fingerprint()
    plan = plan_key(cfg, fingerprint)
    if state.is_main_process:
        claim = claim_stage(out, STAGE, plan, overwrite=gen.overwrite,
                            started=lambda folder: any((folder / "shards").glob("shard-*")))
        own_dir(claim.folder / "shards", "shards")
        remove_stale_temp_dirs(claim.folder / "shards")  # shards a killed process did not finish
    state.wait_for_everyone()
    if not state.is_main_process:
        claim = find_claim(out, STAGE, plan)
    if claim.done and not gen.retry_failed:
        log.info("generate stage already complete in %s", out)
        return out
    work, shards_dir = claim.folder, claim.folder / "shards"
    if claim.aside:
        log.info("generate: %s stays as it is until this run (in %s) is complete", out, work)
    plan_hash = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:12]

    data = load_chat_data(cfg.data, target.tokenizer, max_context=gen.max_length - gen.max_new_tokens)
    convs = data.conversations
    shards = in_shards(convs, gen.shard_size)
    tracker = start_tracker(
        cfg.logger.kind, run_name=cfg.run, stage=STAGE, config=dataclasses.asdict(cfg), log_dir=out.parent,
        project=cfg.logger.project, entity=cfg.logger.entity, mode=cfg.logger.mode,
        is_main_process=state.is_main_process,
    )
    done = Done(cfg, target, fingerprint, plan_hash, dict(data.skipped), tracker)
    if not claim.done:
        mine = [s for s in range(len(shards)) if s % state.num_processes == state.process_index]
        finished = {s for s in range(len(shards)) if (shards_dir / shard_name(s)).is_dir()}
        todo = {s: shards[s] for s in mine if s not in finished}
        if state.is_main_process:
            log.info("%d conversations from %s in %d shards (%d already done), %d processes",
                     len(convs), cfg.data.source, len(shards), len(finished), state.num_processes)
        if todo:
            with progress_bar(todo, cfg, "generate", disable=not state.is_main_process) as progress:
                BACKENDS[gen.backend](cfg, target, todo, shards_dir, progress, tracker)
        state.wait_for_everyone()
        if state.is_main_process:
            merged = merge_shards([shards_dir / shard_name(s) for s in range(len(shards))], work / "dataset",
                                  gen.save_topk_logits)
            done.complete(claim, merged, time.perf_counter() - t0)
    if gen.retry_failed and state.is_main_process:  # the others wait: failures are few
        retry_failed(done, out, convs)
    tracker.finish()
    state.wait_for_everyone()
    return out


def in_shards(convs: list[Conversation], size: int) -> list[list[Conversation]]:
    return [convs[i : i + size] for i in range(0, len(convs), size)]


@contextmanager
def progress_bar(shards: dict[int, list[Conversation]], cfg: Config, desc: str, disable: bool):
    """A bar over the planned turns of `shards`' conversations; yields progress(turns, tokens)."""
    total = sum(planned_turns(c, cfg.data.max_turns, cfg.generate.target_answers) for convs in shards.values()
                for c in convs)
    bar = tqdm(total=total, unit="turn", desc=desc, disable=disable, dynamic_ncols=True)
    tokens = Counter()

    def progress(turns: int, new_tokens: int) -> None:
        tokens["n"] += new_tokens
        bar.update(turns)
        bar.set_postfix(tok_s=f"{tokens['n'] / max(bar.format_dict['elapsed'], 1e-9):.1f}")

    try:
        yield progress
    finally:
        bar.close()  # before an error's line


@dataclass
class Done:
    """What the manifest of a finished stage is written from (complete)."""

    cfg: Config
    target: Target
    fingerprint: Optional[str]
    plan_hash: str
    data_skipped: dict[str, int]
    """The data's records skipped before generation (load_chat_data), by reason."""
    tracker: object

    def complete(self, claim: Claim, merged: Merged, wall_s: float) -> None:
        """Write the manifest of `merged` (in claim.folder, beside its dataset) and put the stage
        in place; say what it holds."""
        gen, work = self.cfg.generate, claim.folder
        summary = summarize(merged, self.data_skipped, gen.backend)
        failed = sum(summary["skipped_records"].get(reason, 0) for reason in FAILURES)
        if not merged.rows and not failed:
            raise PipelineError(f"generate: no conversation fits generate.max_length={gen.max_length} with "
                                f"max_new_tokens={gen.max_new_tokens} (skipped records: {summary['skipped_records']})")
        summary["plan_hash"] = self.plan_hash
        if gen.backend == "server":
            summary["server"] = dict(model=server_model(work / "shards"), urls=list(gen.server.urls),
                                     **summary.pop("server_counts"), failed_conversations=merged.failed)
        summary.pop("server_counts", None)
        write_manifest(
            work, stage=STAGE, config=dataclasses.asdict(self.cfg), target_fingerprint=self.fingerprint,
            outputs={f"dataset/{k}": v for k, v in hash_tree(work / "dataset").items()},
            wall_time_s=wall_s, target_name=self.target.name,
            counts={k: n for k, n in sorted(merged.counts.items()) if n}, **summary,
        )
        remove(work / "shards")
        complete_claim(claim)
        dataset_dir = claim.out / "dataset"
        self.tracker.log({"generate/" + k: v for k, v in summary.items() if isinstance(v, (int, float))})
        skipped_text = ", ".join(f"{n} {r}" for r, n in summary["skipped_records"].items()) or "none"
        cut = sum(summary["cut_turns"].values())
        log.info("generated %d tokens (and scored %d of the source's) for %d conversations in %.1fs "
                 "(skipped records: %s%s)", merged.generated_tokens, merged.scored_tokens, merged.rows, wall_s,
                 skipped_text, f"; {cut} later turns cut by generate.max_length" if cut else "")
        print(example(dataset_dir, self.target.tokenizer))
        print(f"generate: {merged.rows} conversations, {merged.generated_tokens} generated tokens"
              f"{origin(summary, merged.scored_tokens)} -> {dataset_dir}")
        if failed:
            log.warning("generate: %d conversations were skipped after failed requests or malformed answers "
                        "(manifest: server.failed_conversations); once the server answers, run the same command "
                        "with generate.retry_failed=true to ask for them again", failed)


def summarize(merged: Merged, data_skipped: dict[str, int], backend: str) -> dict:
    """The manifest's counts from what the shards counted (merged.counts)."""
    counts = Counter(merged.counts)
    skipped = Counter(data_skipped)
    for reason in ("too_long_for_max_length", *FAILURES):
        skipped[reason] += counts.pop(reason, 0)
    server_counts = dict(answer_tokens={name: counts.pop(name, 0) for name in ROUND_TRIP},
                         answer_too_long=counts.pop("answer_too_long", 0))
    return {
        "num_conversations": merged.rows,
        "num_generated_tokens": merged.generated_tokens,
        "num_scored_source_tokens": merged.scored_tokens,
        "skipped_records": {reason: n for reason, n in sorted(skipped.items()) if n},
        "cut_turns": {reason: n for reason, n in counts.items() if n},
        "num_processes": process_state().num_processes,
        "backend": backend,
        "server_counts": server_counts,
    }


def origin(summary: dict, scored: int) -> str:
    """Where the tokens of the stage's last line came from, and what of them was left out."""
    if "server" not in summary:
        return f" + {scored} scored source tokens" if scored else ""
    server, skipped = summary["server"], summary["skipped_records"]
    tokens = server["answer_tokens"]
    notes = [f"{tokens['round_tripped']} answer tokens round-trip through the tokenizer, "
             f"{tokens['not_round_tripped']} do not and are not learned"]
    for name, what in (("end_of_turn_without_logprobs", "ends of turn without logprobs"),
                       ("without_topk", "learned tokens left out for a top-k of no known token")):
        if tokens.get(name):
            notes.append(f"{tokens[name]} {what}")
    if server["answer_too_long"]:
        notes.append(f"{server['answer_too_long']} answers longer than max_new_tokens cut")
    failed = [f"{skipped[reason]} {reason}" for reason in FAILURES if skipped.get(reason)]
    if failed:
        notes.append(f"conversations skipped: {', '.join(failed)}")
    return f" from {server['model']} ({'; '.join(notes)})"


RETRY = "retry.json"
"""In the folder a retry_failed run works in: the sha256 of the finished manifest it retries."""


def retry_failed(done: Done, out: Path, convs: list[Conversation]) -> None:
    """generate.retry_failed=true: ask the server again for the conversations the finished stage
    in `out` skipped after failed requests or malformed answers, and only them, then merge them
    in at their places. The work goes on beside `out` (resumed there after a kill, like any run)
    and replaces it only once merged, so `out` stays valid meanwhile."""
    t0 = time.perf_counter()
    cfg = done.cfg
    manifest = read_manifest(out, STAGE)
    failed = (manifest.get("server") or {}).get("failed_conversations") or {}
    if not failed:
        log.info("generate: %s has no failed conversation to ask for again", out)
        return
    work, base = aside_dir(out), {"manifest_sha256": manifest_sha(out)}
    if work.exists() and read_json(work / RETRY) != base:
        remove(work)  # another run's folder, or a retry of an earlier result
    own_dir(work, STAGE)
    claim = Claim(out, work)
    if is_finished(work, STAGE):  # killed between finishing and swapping it in
        complete_claim(claim)
        return
    atomic_write_json(work / PLAN, read_plan(out))
    atomic_write_json(work / RETRY, base)
    shards_dir = own_dir(work / "shards", "shards")
    remove_stale_temp_dirs(shards_dir)
    if not (shards_dir / SERVER).is_file():  # the model the stage's answers came from
        atomic_write_json(shards_dir / SERVER, dict(model=manifest["server"]["model"]))
    shards = in_shards([c for c in convs if c.id in failed], cfg.generate.shard_size)
    todo = {s: shard for s, shard in enumerate(shards) if not (shards_dir / shard_name(s)).is_dir()}
    log.info("generate: asking %s again for the %d conversations it failed (%s)", manifest["server"]["model"],
             len(failed), ", ".join(f"{n} {r}" for r, n in sorted(Counter(failed.values()).items())))
    if todo:
        with progress_bar(todo, cfg, "generate (retry)", disable=False) as progress:
            generate_remotely(cfg, done.target, todo, shards_dir, progress, done.tracker)
    merged = merge_shards([shards_dir / shard_name(s) for s in range(len(shards))], work / "dataset",
                          cfg.generate.save_topk_logits, base=out / "dataset", order=[c.id for c in convs])
    counts = Counter(manifest.get("counts") or {})
    counts.subtract(Counter(failed.values()))  # each asked again: counted anew by its shard
    counts.update(merged.counts)
    merged.counts = +counts
    done.complete(claim, merged, manifest["wall_time_s"] + time.perf_counter() - t0)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def example(dataset_dir: Path, tokenizer, width: int = 300) -> str:
    """The first learned answer of the first regenerated conversation that has one (else of
    any conversation), shortened."""
    import datasets

    row = None
    for candidate in datasets.load_from_disk(str(dataset_dir)).select_columns(["id", "source", "answers",
                                                                              "input_ids", "loss_mask"]):
        if 1 not in candidate["loss_mask"]:
            continue
        if row is None or candidate["answers"] == "target":
            row = candidate
        if candidate["answers"] == "target":
            break
    if row is None:
        return "no conversation has a learned answer token"
    mask = row["loss_mask"]
    start = mask.index(1)
    end = next((i for i in range(start, len(mask)) if not mask[i]), len(mask))
    answer = " ".join(tokenizer.decode(row["input_ids"][start:end], skip_special_tokens=True).split())
    kind = "regenerated" if row["answers"] == "target" else "scored source"
    return f"first {kind} answer ({row['source']} {row['id']}): {answer[:width]}{' ...' if len(answer) > width else ''}"


def generate_locally(cfg: Config, target: Target, shards: dict[int, list[Conversation]], shards_dir: Path,
                     progress: Callable[[int, int], None], tracker) -> None:
    """generate.backend=local: the shards' conversations decoded here (regenerate), one shard
    after the other, each written when done."""
    gen = cfg.generate
    static = StaticModel(target.model, use_graphs(gen.cuda_graphs, target.device.type, target.split, "generate"))
    for s, convs in shards.items():
        # A shard's seed depends only on its index: a resumed or re-split run samples the same.
        torch.manual_seed(cfg.seed * 1_000_003 + s)
        shard_t0, made, dropped = time.perf_counter(), Counter(), Counter()

        def counted(turns: int, tokens: int) -> None:
            made["tokens"] += tokens
            progress(turns, tokens)

        rows = regenerate(
            target, convs, max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
            batch_size=gen.batch_size, max_length=gen.max_length, max_turns=cfg.data.max_turns,
            target_answers=gen.target_answers, topk=gen.save_topk_logits, progress=counted, dropped=dropped,
            static=static,
        )
        if gen.save_topk_logits:
            scored = [r for r in rows if r["answers"] == "source"]
            topk_logits(target.model, scored, gen.save_topk_logits, gen.batch_size)
        write_shard(shards_dir / shard_name(s), rows, gen.save_topk_logits, dropped)
        tracker.log({"generate/shard": s, "generate/tokens": made["tokens"],
                     "generate/tokens_per_s": made["tokens"] / (time.perf_counter() - shard_t0)})


ROUND_TRIP = ("round_tripped", "not_round_tripped", "end_of_turn_without_logprobs", "without_topk")
SERVER = "server.json"


def generate_remotely(cfg: Config, target: Target, shards: dict[int, list[Conversation]], shards_dir: Path,
                      progress: Callable[[int, int], None], tracker) -> None:
    """generate.backend=server: the shards' conversations answered by the server (data/server.py),
    each shard written as it completes, the served model id in SERVER beside them."""
    from pipeline.data.server import Pieces, ServerGone, Settings, generate_shards

    gen, tok = cfg.generate, target.tokenizer
    eos_list = eos_token_ids(target.generation_config, tok)
    settings = Settings(tokenizer=tok, pieces=Pieces(tok), max_new_tokens=gen.max_new_tokens,
                        temperature=gen.temperature, top_p=gen.top_p, max_length=gen.max_length,
                        max_turns=cfg.data.max_turns, topk=gen.save_topk_logits,
                        end_of_turn=end_of_turn_id(tok, eos_list), eos_ids=set(eos_list), seed=cfg.seed)
    probe = first_prompt_ids(tok, Conversation(id="probe", source="", user_turns=["Hello"]))
    done = []

    def write(index: int, rows: list[dict], counts: Counter, failed: dict[str, str], model: str) -> None:
        if not done:
            atomic_write_json(shards_dir / SERVER, dict(model=model))
        write_shard(shards_dir / shard_name(index), rows, gen.save_topk_logits, counts, failed)
        done.append(index)

    try:
        generate_shards(gen.server, shards, settings, write, probe, progress, expected_model=server_model(shards_dir))
    except ServerGone as e:
        raise PipelineError(f"{e}; {len(done)} of {len(shards)} shards were finished and are kept: restart the "
                            f"server and run the same command again to resume") from None


def served_fingerprint(target: Target) -> Optional[str]:
    """The target's fingerprint where its weights are on this disk; for a target only served
    (its tokenizer and config here) None, and the later stages' check that they load the same
    target is left to them."""
    try:
        return target.fingerprint()
    except PipelineError as e:
        log.warning("generate: %s; the dataset records no target fingerprint", e)
        return None


def server_model(shards_dir: Path) -> Optional[str]:
    path = shards_dir / SERVER
    return json.loads(path.read_text())["model"] if path.is_file() else None


BACKENDS = {"local": generate_locally, "server": generate_remotely}
"""generate.backend -> (cfg, target, shards to do, shards folder, progress, tracker): writes them."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


DROPPED = "dropped.json"
FAILED = "failed.json"


def write_shard(path: Path, rows: list[dict], topk: int, dropped: Counter,
                failed: Optional[dict[str, str]] = None) -> None:
    """One shard, whole or not at all: its rows, what was left out or cut of them (DROPPED) and
    the conversations a server failed, {id: reason} (FAILED). A shard of no rows is a dataset of
    one empty file (load_from_disk reads no other empty dataset)."""
    import datasets

    with atomic_dir(path, "shard") as tmp:
        columns = features(topk)
        table = datasets.Dataset.from_list(rows, features=columns) if rows else \
            datasets.Dataset.from_dict({name: [] for name in columns}, features=columns)
        table.save_to_disk(str(tmp), num_shards=1)
        atomic_write_json(tmp / DROPPED, dict(dropped))
        if failed:
            atomic_write_json(tmp / FAILED, failed)


@dataclass
class Merged:
    """The dataset merge_shards wrote, and what its shards counted."""

    rows: int
    generated_tokens: int
    scored_tokens: int
    counts: Counter
    """Summed over the shards: what was left out (by reason), cut, and round trips."""
    failed: dict[str, str]
    """The conversations a server failed, {id: reason}."""


def merge_shards(shard_paths: list[Path], dataset_dir: Path, topk: int, base: Optional[Path] = None,
                 order: Optional[list[str]] = None) -> Merged:
    """Concatenate the shards in index order into one dataset (after the dataset `base`, and in
    the order of the ids `order`, where given)."""
    import datasets

    missing = [p.name for p in shard_paths if not p.is_dir()]
    if missing:
        raise PipelineError(f"shards missing after all processes finished: {', '.join(missing)}")
    counts, failed = Counter(), {}
    for p in shard_paths:
        counts.update(read_json(p / DROPPED) or {})
        failed.update(read_json(p / FAILED) or {})
    parts = [datasets.load_from_disk(str(base))] if base is not None else []
    parts += [datasets.load_from_disk(str(p)) for p in shard_paths if has_rows(p)]
    parts = [part for part in parts if len(part)]
    if parts:
        merged = datasets.concatenate_datasets(parts)
    else:
        columns = features(topk)
        merged = datasets.Dataset.from_dict({name: [] for name in columns}, features=columns)
    if order is not None:
        place = {conv_id: i for i, conv_id in enumerate(order)}
        ids = merged["id"]
        merged = merged.select(sorted(range(len(merged)), key=lambda r: place[ids[r]]))
    with atomic_dir(dataset_dir, "dataset") as tmp:
        merged.save_to_disk(str(tmp), num_shards=1 if not len(merged) else None)
    masks = merged["loss_mask"]
    scored = sum(sum(m) for m, a in zip(masks, merged["answers"]) if a == "source")
    return Merged(len(merged), sum(sum(m) for m in masks) - scored, scored, counts, failed)


def has_rows(shard: Path) -> bool:
    """Whether a shard's dataset has a data file: the code before write_shard's num_shards=1 saved
    a shard of no rows with none, which load_from_disk cannot read (a run it wedged completes)."""
    return bool((read_json(shard / "state.json") or {}).get("_data_files"))
