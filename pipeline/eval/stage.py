"""The eval stage: acceptance and real speedup of every drafter, measured in one process.

Output (`runs/<run>/eval/`): report.json, report.md, acceptance_by_position.png,
speedup_vs_k.png, per_category.png, manifest.json.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from pipeline.config import Config
from pipeline.data.chat import eos_token_ids, first_prompt_ids, load_chat_data
from pipeline.decode.attention import gqa_attention
from pipeline.decode.layout import decode_layout, int8_linears, is_int8
from pipeline.distill.draft import check_vocabulary, read_draft_vocab, restrict_vocabulary
from pipeline.errors import PipelineError
from pipeline.eval.measure import (
    Measurement, Method, Settings, forward_step, greedy_divergences, heads_step, make_decode, measure,
    median_seconds, predicted_speedup,
)
from pipeline.eval.report import write_report
from pipeline.models import Target, load_target
from pipeline.files import remove
from pipeline.runs import (
    MANIFEST, check_trained, consumed, hash_tree, own_stage_dir, read_manifest, stage_dir, write_manifest,
)
from pipeline.tracking import start_tracker

log = logging.getLogger(__name__)
STAGE = "eval"
HF_EQUIVALENT = {"ngram": "hf_prompt_lookup", "draft_model": "hf_assisted"}


def load_draft(path: Path, target: Target) -> torch.nn.Module:
    """A separate draft model from a save_pretrained folder (safetensors), on the target's device and dtype."""
    from transformers import AutoModelForCausalLM

    if not path.is_dir():
        raise PipelineError(f"draft folder {path} does not exist")
    dtype = next(target.model.parameters()).dtype
    try:
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot load a draft model from {path}: {str(e).strip().splitlines()[0]}") from None
    check_vocabulary(draft, target.model, str(path))
    draft.draft_to_target = read_draft_vocab(path, target.model.config.vocab_size)
    return draft.to(target.device).eval()


def find_drafts(cfg: Config, target: Target, heads: dict[str, torch.nn.Module]) -> tuple[dict[str, torch.nn.Module], dict[str, int]]:
    """The run's distilled draft (if its stage finished), eval.draft and eval.bundle, by method
    name; and the num_draft_tokens a bundle was exported with, by method name. A bundle of
    heads joins `heads` (as `<kind>`, or `<kind>:bundle` when the run has its own)."""
    drafts, bundle_k = {}, {}
    distill = stage_dir(cfg.runs_dir, cfg.run, "distill")
    if (distill / MANIFEST).is_file():
        manifest = read_manifest(distill, "distill", cfg.run)
        check_trained(manifest, distill, stage_dir(cfg.runs_dir, cfg.run, "generate"), cfg.run)
        drafts["draft_model"] = load_draft(distill / "checkpoint", target)
    if cfg.eval.draft:
        path = Path(cfg.eval.draft).expanduser()
        drafts["draft_model" if not drafts else f"draft_model:{path.name}"] = load_draft(path, target)
    if cfg.eval.bundle:
        from pipeline.export import load_bundle

        bundle = load_bundle(cfg.eval.bundle, target)
        if bundle.method == "draft_model":
            name = "draft_model" if not drafts else "draft_model:bundle"
            drafts[name] = bundle.draft
        else:
            name = bundle.method if bundle.method not in heads else f"{bundle.method}:bundle"
            heads[name] = bundle.draft
        bundle_k[name] = bundle.num_draft_tokens
        log.info("eval: bundle %s (target fingerprint and checksums verified), num_draft_tokens %d",
                 bundle.path, bundle.num_draft_tokens)
    return drafts, bundle_k


HEAD_KINDS = ("medusa", "eagle", "early_exit")


def find_heads(cfg: Config, target: Target) -> dict[str, torch.nn.Module]:
    """The run's trained heads (runs/<run>/heads/<kind>/, stage finished), by method name."""
    from pipeline.heads.models import load_heads

    found = {}
    for kind in HEAD_KINDS:
        folder = stage_dir(cfg.runs_dir, cfg.run, "heads") / kind
        if (folder / MANIFEST).is_file():
            manifest = read_manifest(folder, "heads", cfg.run, extra=f"heads={kind}")
            check_trained(manifest, folder, stage_dir(cfg.runs_dir, cfg.run, "generate"), cfg.run, f"heads={kind}")
            if manifest.get("target_fingerprint") != target.fingerprint():
                raise PipelineError(f"{folder} was trained on another target (fingerprint "
                                    f"{str(manifest.get('target_fingerprint'))[:12]}…); retrain it for this one")
            found[kind] = load_heads(folder, target.model)
    return found


def prepare_for_decoding(model: torch.nn.Module, drafts: dict[str, torch.nn.Module], *, layout: bool,
                         compare_hf: bool, heads: Optional[dict[str, torch.nn.Module]] = None,
                         int8: tuple[str, ...] = ()):
    """Prepare the target and drafts for our decoder, in place: drafts with a draft vocabulary
    keep only its LM-head rows (distill/draft.py), the drafts and heads named in `int8` run
    their own CPU linear layers in int8 (decode/layout.py), and on CPU with `layout` every linear layer
    runs few-row inputs through the small-batch product (decode/layout.py) and grouped-query
    attention reads the cache without copying it per head (decode/attention.py).

    Returns the target and drafts for HF's methods: copies as transformers loaded them (where
    anything changed), so that HF generate runs on the model every transformers user gets. The
    copy costs the target's weights in memory once more."""
    layout = layout and next(model.parameters()).device.type == "cpu"
    restricted = {name for name, d in drafts.items() if getattr(d, "draft_to_target", None) is not None}
    hf_model = copy.deepcopy(model) if layout else model
    hf_drafts = {name: copy.deepcopy(d) if layout or name in restricted or name in int8 else d
                 for name, d in drafts.items()} if compare_hf else {}
    for name in restricted:
        restrict_vocabulary(drafts[name], drafts[name].draft_to_target)
        log.info("%s proposes from its draft vocabulary of %d tokens", name, len(drafts[name].draft_to_target))
    for name in int8:
        if changed := int8_linears(drafts[name] if name in drafts else heads[name]):
            log.info("%s: %d linear layers in int8 (dynamic activations)", name, changed)
    if layout:
        moved = sum(decode_layout(m) for m in (model, *drafts.values(), *(heads or {}).values()))
        grouped = sum(gqa_attention(m) for m in (model, *drafts.values()))
        log.info("decode layout: %d linear layers use the small-batch product and %d models SDPA's own "
                 "grouped-query attention for our decoder; HF methods use a copy", moved, grouped)
    return hf_model, hf_drafts


def summary(m: Measurement, plain: Measurement, hf: Optional[Measurement]) -> dict:
    per_category = {}
    for cat, counts in sorted(m.per_category.items()):
        base = plain.per_category[cat]
        per_category[cat] = dict(tau=counts.tau, tokens_per_s=counts.tokens_per_s,
                                 speedup_vs_plain=counts.tokens_per_s / base.tokens_per_s if base.tokens_per_s else None)
    return dict(
        drafter=m.drafter,
        num_draft_tokens=m.num_draft_tokens,
        tau=m.total.tau,
        acceptance_by_position=m.acceptance_by_position,
        tokens=m.total.tokens,
        seconds=m.total.seconds,
        tokens_per_s=m.total.tokens_per_s,
        speedup_vs_plain=m.total.tokens_per_s / plain.total.tokens_per_s,
        speedup_vs_hf=m.total.tokens_per_s / hf.total.tokens_per_s if hf else None,
        per_category=per_category,
    )


def losslessness(model, plain: Measurement, m: Measurement, greedy: bool, name: str) -> dict:
    """Greedy outputs compared with plain decoding; a divergence is excused only at an exact tie."""
    if not greedy:
        return dict(lossless=None)  # sampled outputs differ by chance; the distribution tests cover it
    found = greedy_divergences(model, plain, m)
    ties = sum(d.tie for d in found)
    if found:
        log.warning("%s: %d outputs differ from plain decoding (%d at exact logit ties)", name, len(found), ties)
    return dict(lossless=len(found) == ties, divergences=len(found), tie_divergences=ties)


def run(cfg: Config) -> Path:
    t0 = time.perf_counter()
    out = own_stage_dir(stage_dir(cfg.runs_dir, cfg.run, STAGE), STAGE)
    remove(out / MANIFEST)  # the folder is incomplete until this run finishes
    ev = cfg.eval

    target = load_target(**dataclasses.asdict(cfg.target))
    heads = find_heads(cfg, target)
    run_heads = list(heads)
    drafts, bundle_k = find_drafts(cfg, target, heads)
    # Medusa heads only: EAGLE feeds its own features back, so int8 error compounds along a chain
    # (recipe4: eagle_tree τ 1.55 in int8 against 1.70 in fp32); early exit is the target's own layers.
    int8 = (*drafts, *(n for n, h in heads.items() if h.kind == "medusa")) if ev.draft_int8 else ()
    if ev.draft_int8 and ev.compare_draft_fp32:
        for found in (drafts, heads):
            found.update({f"{name}:fp32": copy.deepcopy(d) for name, d in list(found.items()) if name in int8})
        bundle_k.update({f"{name}:fp32": k for name, k in list(bundle_k.items()) if name in int8})
    tok = target.tokenizer
    data = load_chat_data(cfg.data, tok)
    convs = data.conversations[: ev.max_prompts]
    hf_model, hf_drafts = prepare_for_decoding(target.model, drafts, layout=ev.decode_layout, compare_hf=ev.compare_hf,
                                               heads=heads, int8=int8)
    settings = Settings(model=target.model, tokenizer=tok, eos_ids=set(eos_token_ids(target.model, tok)),
                        max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, top_p=ev.top_p,
                        seed=cfg.seed, ngram_max=ev.ngram_max, ngram_min=ev.ngram_min, hf_model=hf_model,
                        tree_depth=ev.tree_depth, tree_topk=ev.tree_topk, medusa_choices=ev.medusa_choices,
                        confidence_threshold=ev.confidence_threshold)
    greedy = ev.temperature == 0
    num_turns = sum(min(len(c.user_turns), cfg.data.max_turns or 99) for c in convs)
    spec = (([("ngram", "ngram", None)] if ev.ngram else []) + [(n, "draft_model", d) for n, d in drafts.items()]
            + [(name, module.kind, module) for name, module in heads.items()]
            + [(f"{name.split(':')[0]}_tree{name[len(name.split(':')[0]):]}", f"{module.kind}_tree", module)
               for name, module in heads.items() if ev.trees and module.kind in ("medusa", "eagle")])
    sweep_of = lambda drafter: ev.tree_budgets if drafter.endswith("_tree") else ev.sweep
    log.info("eval: %d conversations (%d turns) from %s; methods plain, hf_generate, %s",
             len(convs), num_turns, cfg.data.source, ", ".join(n for n, _, _ in spec) or "no drafters")

    def method(drafter: str, k: Optional[int] = None, draft=None) -> Method:
        return Method(make_decode(drafter, settings, k, draft), drafter, k)

    def run_methods(methods: dict[str, Method], conversations, max_turns, desc: str) -> dict[str, Measurement]:
        turns = sum(min(len(c.user_turns), max_turns or 99) for c in conversations)
        with tqdm(total=turns * len(methods), desc=desc, unit="turn", dynamic_ncols=True) as bar:
            results = measure(methods, conversations, settings, batch_size=ev.batch_size, max_turns=max_turns,
                              on_step=bar.update)
        for name, m in results.items():
            tau = f"{m.total.tau:.2f}" if m.total.tau else "–"
            log.info("%-28s %7.2f tokens/s  tau %s", name, m.total.tokens_per_s, tau)
        return results

    # Warm-up: the first calls pay for allocations and thread pools, not for a method.
    short = dataclasses.replace(settings, max_new_tokens=4)
    make_decode("plain", short)([first_prompt_ids(tok, convs[0])])
    for _, drafter, draft in spec:
        make_decode(drafter, short, 2, draft)([first_prompt_ids(tok, convs[0])])

    # Costs that explain speedups: a target forward of k+1 tokens and a draft forward, per target token.
    ks = sorted(set(ev.sweep) | set(bundle_k.values()) | (set(ev.tree_budgets) if ev.trees and heads else set())
                | ({ev.fixed_num_draft_tokens} if ev.fixed_num_draft_tokens else set()))
    steps = {"one": forward_step(target.model, 1)}
    steps.update({f"verify {k}": forward_step(target.model, k + 1) for k in ks})
    steps.update({f"draft {name}": forward_step(d, 1) for name, d in drafts.items()})
    per_step = {name: heads_step(module, target.model) for name, module in heads.items()}
    steps.update({f"draft {name}": step for name, (step, _) in per_step.items()})
    seconds = median_seconds(steps, target.model)
    one = seconds["one"]
    verify_cost = {k: seconds[f"verify {k}"] / one for k in ks}
    draft_cost = {name: seconds[f"draft {name}"] / one for name in drafts}
    draft_cost.update({name: seconds[f"draft {name}"] / tokens / one for name, (_, tokens) in per_step.items()})
    cost_of = lambda name: draft_cost.get(name.replace("_tree", ""), 0.0)  # a tree's head: per draft step

    def predicted(name: str, m: Measurement, k: int) -> Optional[float]:
        if "_tree" in name:  # a tree's draft work is not k chain steps: no simple model
            return None
        if k > 1 and ev.confidence_threshold > 0 and m.drafter in ("draft_model", "eagle", "early_exit"):
            return None  # chains that end early: neither k draft steps nor k verified positions
        return predicted_speedup(m.acceptance_by_position, cost_of(name), verify_cost[k], m.proposal_rate)

    sweeps, chosen = {}, {}
    if ev.fixed_num_draft_tokens is not None:
        chosen = {name: ev.fixed_num_draft_tokens for name, _, _ in spec}
    else:
        chosen = dict(bundle_k)  # a bundle runs at the num_draft_tokens it was exported with
    swept_spec = [(name, drafter, draft) for name, drafter, draft in spec if name not in chosen]
    if swept_spec:
        candidates = {"plain": method("plain")}
        candidates.update({f"{name} k={k}": method(drafter, k, draft) for name, drafter, draft in swept_spec
                           for k in sweep_of(drafter)})
        swept = run_methods(candidates, convs[: ev.sweep_prompts], cfg.data.max_turns, "eval sweep")
        base = swept["plain"].total.tokens_per_s
        for name, drafter, _ in swept_spec:
            rows = []
            for k in sweep_of(drafter):
                m = swept[f"{name} k={k}"]
                rows.append(dict(num_draft_tokens=k, tau=m.total.tau, acceptance_by_position=m.acceptance_by_position,
                                 tokens_per_s=m.total.tokens_per_s, speedup_vs_plain=m.total.tokens_per_s / base,
                                 proposal_rate=m.proposal_rate, predicted_speedup=predicted(name, m, k)))
            sweeps[name] = rows
            chosen[name] = max(rows, key=lambda r: r["tokens_per_s"])["num_draft_tokens"]

    final = {"plain": method("plain"), "hf_generate": method("hf_generate")}
    hf_names = {}
    for name, drafter, draft in spec:
        final[name] = method(drafter, chosen[name], draft)
        if ev.compare_hf and drafter in HF_EQUIVALENT:
            hf_names[name] = HF_EQUIVALENT[drafter] + name[len(drafter):]
            final[hf_names[name]] = method(HF_EQUIVALENT[drafter], chosen[name], hf_drafts.get(name))
    results = run_methods(final, convs, cfg.data.max_turns, "eval")
    plain, hf = results["plain"], results["hf_generate"]

    methods = {"plain": {**summary(plain, plain, hf), "drafter": "none", "lossless": True}}
    hf_methods = {}
    for name, drafter, draft in spec:
        k, m = chosen[name], results[name]
        entry = summary(m, plain, hf)
        entry["num_draft_tokens_mode"] = ("auto" if name in sweeps
                                          else "fixed" if ev.fixed_num_draft_tokens is not None else "bundle")
        entry["proposal_rate"] = m.proposal_rate
        entry["predicted_speedup"] = predicted(name, m, k)
        entry["draft_cost_ratio"] = cost_of(name)
        methods[name] = {**entry, **losslessness(target.model, plain, m, greedy, name)}
        if name in hf_names:
            h = results[hf_names[name]].total
            hf_methods[hf_names[name]] = dict(num_draft_tokens=k, tokens_per_s=h.tokens_per_s, ours=name,
                                              speedup_vs_plain=h.tokens_per_s / plain.total.tokens_per_s,
                                              speedup_vs_hf=h.tokens_per_s / hf.total.tokens_per_s)

    report = dict(
        target=dict(name=target.name, fingerprint=target.fingerprint()),
        dataset=cfg.data.source if cfg.data.source != "file" else cfg.data.path,
        num_prompts=len(convs), num_turns=num_turns, max_new_tokens=ev.max_new_tokens,
        temperature=ev.temperature, top_p=ev.top_p, batch_size=ev.batch_size,
        device=str(target.device), dtype=str(next(target.model.parameters()).dtype).replace("torch.", ""),
        threads=torch.get_num_threads(), sweep_prompts=ev.sweep_prompts,
        confidence_threshold=ev.confidence_threshold, int8_drafts=[n for n in int8 if is_int8({**drafts, **heads}[n])],
        baselines=dict(plain=dict(tokens_per_s=plain.total.tokens_per_s, tokens=plain.total.tokens,
                                  seconds=plain.total.seconds),
                       hf_generate=dict(tokens_per_s=hf.total.tokens_per_s, tokens=hf.total.tokens,
                                        seconds=hf.total.seconds,
                                        **losslessness(target.model, plain, hf, greedy, "hf_generate"))),
        methods=methods, sweeps=sweeps, hf_methods=hf_methods,
        costs=dict(target_forward_s=one, verify_cost_by_k={str(k): v for k, v in verify_cost.items()},
                   draft_cost_ratio=draft_cost),
        skipped_records=dict(data.skipped),
    )
    images = write_report(report, out)

    tracker = start_tracker(cfg.logger.kind, run_name=cfg.run, stage=STAGE, config=dataclasses.asdict(cfg),
                            log_dir=out.parent, project=cfg.logger.project, entity=cfg.logger.entity, mode=cfg.logger.mode)
    tracker.log({f"eval/{name}/{key}": value for name, m in methods.items()
                 for key, value in m.items() if isinstance(value, (int, float)) and not isinstance(value, bool)})
    tracker.log_images({f"eval/{name}": path for name, path in images.items()})
    tracker.finish()

    inputs = {}
    distill = stage_dir(cfg.runs_dir, cfg.run, "distill")
    if "draft_model" in drafts and (distill / MANIFEST).is_file():
        inputs["distill"] = consumed(distill)
    for kind in run_heads:
        inputs[f"heads/{kind}"] = consumed(stage_dir(cfg.runs_dir, cfg.run, "heads") / kind)
    if ev.bundle:
        inputs["bundle"] = {"path": str(Path(ev.bundle).expanduser())}
    write_manifest(out, stage=STAGE, config=dataclasses.asdict(cfg), target_fingerprint=report["target"]["fingerprint"],
                   outputs={k: v for k, v in hash_tree(out).items() if k != MANIFEST},
                   wall_time_s=time.perf_counter() - t0, inputs=inputs)
    print(f"eval: {len(methods)} methods on {len(convs)} conversations -> {out / 'report.md'}")
    print(_console_table(report))
    return out


def _console_table(report: dict) -> str:
    rows = [f"{'method':<24} {'k':>3} {'tau':>6} {'tok/s':>8} {'vs plain':>9} {'vs HF':>7} lossless"]
    for name, m in report["methods"].items():
        tau = f"{m['tau']:.2f}" if m["tau"] else "–"
        k = m["num_draft_tokens"] or "–"
        rows.append(f"{name:<24} {k:>3} {tau:>6} {m['tokens_per_s']:>8.2f} {m['speedup_vs_plain']:>8.2f}x "
                    f"{m['speedup_vs_hf']:>6.2f}x {m['lossless']}")
    rows.append(f"{'hf_generate':<24} {'–':>3} {'–':>6} {report['baselines']['hf_generate']['tokens_per_s']:>8.2f}")
    for name, m in report.get("hf_methods", {}).items():
        rows.append(f"{name:<24} {m['num_draft_tokens']:>3} {'–':>6} {m['tokens_per_s']:>8.2f} {m['speedup_vs_plain']:>8.2f}x")
    return "\n".join(rows)
