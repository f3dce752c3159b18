"""The eval stage: acceptance and real speedup of every drafter, measured in one process.

Output (`runs/<run>/eval/`): report.json, report.md, acceptance_by_position.png,
speedup_vs_k.png, per_category.png, manifest.json.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from pipeline.config import Config, use_graphs
from pipeline.data.chat import eos_token_ids, first_prompt_ids, load_chat_data
from pipeline.decode.prepare import prepare_for_decoding
from pipeline.decode.static_kv import StaticModel
from pipeline.distill.draft import load_draft
from pipeline.errors import PipelineError
from pipeline.eval.measure import (
    Measurement, Method, Settings, best_num_draft_tokens, forward_step, greedy_divergences, heads_step, make_decode,
    measure, median_seconds, predicted_speedup, tie_epsilon, tree_round_step,
)
from pipeline.eval.report import write_report
from pipeline.files import remove
from pipeline.kernels.linear import is_int8
from pipeline.kinds import KINDS, TREE_SUFFIX, DraftOptions, Kind, kind_of_method, make_drafter
from pipeline.models import Target, load_target
from pipeline.runs import (
    MANIFEST, check_trained, consumed, hash_tree, own_stage_dir, read_manifest, stage_dir, write_manifest,
)
from pipeline.tracking import start_tracker

log = logging.getLogger(__name__)
STAGE = "eval"
HF_EQUIVALENT = {"ngram": "hf_prompt_lookup", "draft_model": "hf_assisted"}


@dataclass
class Draft:
    """A draft eval measures: its kind and weights (None for ngram), and where it came from."""

    kind: Kind
    module: Optional[torch.nn.Module]
    inputs: Optional[tuple[str, dict]] = None
    """(manifest key, consumed(...)) for a draft trained in this run: eval's manifest records it."""


def tree_name(name: str) -> str:
    """`eagle` -> `eagle_tree`, `eagle:bundle` -> `eagle_tree:bundle`."""
    base, sep, variant = name.partition(":")
    return f"{base}{TREE_SUFFIX}{sep}{variant}"


def find_drafts(cfg: Config, target: Target) -> tuple[dict[str, Draft], dict[str, int]]:
    """Every draft to measure, by method name: the run's (run_drafts) and eval.bundle (with
    eval.engine, the bundle's alone); and the num_draft_tokens a bundle was exported with, by
    method name."""
    found = {} if cfg.eval.engine else run_drafts(cfg, target)
    bundle_k = {}
    if cfg.eval.bundle:
        from pipeline.export import load_bundle

        bundle = load_bundle(cfg.eval.bundle, target)
        name = bundle.method if bundle.method not in found else f"{bundle.method}:bundle"
        found[name] = Draft(KINDS[bundle.method], bundle.draft)
        bundle_k[tree_name(name) if bundle.tree else name] = bundle.num_draft_tokens
        log.info("eval: bundle %s (target fingerprint and checksums verified), %s %d", bundle.path,
                 "tree of" if bundle.tree else "num_draft_tokens", bundle.num_draft_tokens)
    return found, bundle_k


def run_drafts(cfg: Config, target: Target) -> dict[str, Draft]:
    """ngram (eval.ngram), each kind trained in this run (its stage finished, still the one its
    generate stage made) and eval.draft."""
    found: dict[str, Draft] = {"ngram": Draft(KINDS["ngram"], None)} if cfg.eval.ngram else {}
    generate_dir = stage_dir(cfg.runs_dir, cfg.run, "generate")
    for kind in KINDS.values():
        if kind.trained_by is None:
            continue
        folder = kind.trained_folder(cfg.runs_dir, cfg.run)
        if not (folder / MANIFEST).is_file():
            continue
        extra = f"heads={kind.name}" if kind.trained_by == "heads" else ""
        manifest = read_manifest(folder, kind.trained_by, cfg.run, extra=extra)
        check_trained(manifest, folder, generate_dir, cfg.run, extra)
        if manifest.get("target_fingerprint") != target.fingerprint():
            raise PipelineError(f"{folder} was trained on another target (fingerprint "
                                f"{str(manifest.get('target_fingerprint'))[:12]}…); retrain it for this one")
        key = "distill" if kind.trained_by == "distill" else f"heads/{kind.name}"
        found[kind.name] = Draft(kind, kind.load(folder / kind.weights, target), (key, consumed(folder)))
    if cfg.eval.draft:
        path = Path(cfg.eval.draft).expanduser()
        name = "draft_model" if "draft_model" not in found else f"draft_model:{path.name}"
        found[name] = Draft(KINDS["draft_model"], load_draft(path, target))
    return found


def method_list(found: dict[str, Draft], trees: bool) -> list[tuple[str, str, Optional[torch.nn.Module]]]:
    """(method name, drafter, module) of every chain, and of the tree of every kind that has one."""
    methods = [(name, d.kind.name, d.module) for name, d in found.items()]
    if trees:
        methods += [(tree_name(name), d.kind.name + TREE_SUFFIX, d.module) for name, d in found.items() if d.kind.trees]
    return methods


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
    """Greedy outputs compared with plain decoding; a divergence is excused only at a tie (top-2
    logits closer than measure.tie_epsilon: float32 noise, or a few bf16 units on a GPU)."""
    if not greedy:
        return dict(lossless=None)  # sampled outputs differ by chance; the distribution tests cover it
    found = greedy_divergences(model, plain, m)
    ties = sum(d.tie for d in found)
    if found:
        log.warning("%s: %d outputs differ from plain decoding (%d at logit ties)", name, len(found), ties)
    return dict(lossless=len(found) == ties, divergences=len(found), tie_divergences=ties)


@dataclass
class Costs:
    """What a method's target pass costs, in target forwards of one token (medians of
    interleaved timings, measure.median_seconds): the parts of its predicted speedup."""

    target_forward_s: float
    verify: dict[int, float]
    """k -> a target forward of k+1 tokens."""
    draft: dict[str, float]
    """chain method -> one draft token."""
    tree_round: dict[tuple[str, int], float]
    """(tree method, budget) -> one round of tree drafting."""

    def predicted(self, name: str, m: Measurement, k: int, confidence_threshold: float) -> Optional[float]:
        """Tokens per unit of target time over plain decoding's one per pass; None where no
        simple model holds (chains that end early on low confidence)."""
        kind, tree = kind_of_method(name)
        if tree:
            return (m.total.tau or 1.0) / (self.verify[k] + self.tree_round[name, k])
        if k > 1 and confidence_threshold > 0 and kind.stops_early:
            return None  # chains that end early: neither k draft steps nor k verified positions
        return predicted_speedup(m.acceptance_by_position, self.draft.get(name, 0.0), self.verify[k], m.proposal_rate)

    def report(self) -> dict:
        return dict(target_forward_s=self.target_forward_s,
                    verify_cost_by_k={str(k): v for k, v in self.verify.items()}, draft_cost_ratio=self.draft,
                    tree_round_cost={f"{name} {k}": v for (name, k), v in self.tree_round.items()})


def measure_costs(target: StaticModel, methods, ks: list[int], budgets: dict[str, list[int]], ev) -> Costs:
    """Time, round-robin, a target forward of 1 and of k+1 tokens, one draft step of every
    chain draft, and one drafting round of every tree at each budget it may run at."""
    steps = {"one": forward_step(target, 1)}
    steps.update({("verify", k): forward_step(target, k + 1) for k in ks})
    tokens = {}
    for name, drafter, module in methods:
        kind, tree = kind_of_method(name)
        if tree:
            for b in budgets[name]:
                made = make_drafter(kind.name, module, target.model, tree_depth=ev.tree_depth, tree_topk=ev.tree_topk,
                                    medusa_choices=ev.medusa_choices, graphs=target.graphs)
                steps[("tree", name, b)] = tree_round_step(made, target.model, b)
        elif kind.trained_by == "distill":
            steps[("draft", name)], tokens[name] = forward_step(StaticModel(module, target.graphs), 1,
                                                                logits_to_keep=1), 1
        elif kind.trained_by == "heads":
            steps[("draft", name)], tokens[name] = heads_step(module, target.model, target.graphs)
    seconds = median_seconds(steps, target.model, reps=15)  # 15: a median that holds when a few in 5 calls stall
    one = seconds["one"]
    return Costs(target_forward_s=one, verify={k: seconds[("verify", k)] / one for k in ks},
                 draft={name: seconds[("draft", name)] / n / one for name, n in tokens.items()},
                 tree_round={(key[1], key[2]): seconds[key] / one for key in seconds if key[0] == "tree"})


def run(cfg: Config) -> Path:
    t0 = time.perf_counter()
    # An engine check of a bundle is written beside the run's eval, which export reads.
    out = own_stage_dir(stage_dir(cfg.runs_dir, cfg.run, f"{STAGE}-{cfg.eval.engine}" if cfg.eval.engine else STAGE),
                        STAGE)
    remove(out / MANIFEST)  # the folder is incomplete until this run finishes
    ev = cfg.eval

    target = load_target(**dataclasses.asdict(cfg.target))
    found, bundle_k = find_drafts(cfg, target)
    int8 = [name for name, d in found.items() if d.kind.int8] if ev.draft_int8 else []
    if ev.draft_int8 and ev.compare_draft_fp32:
        for name in list(int8):
            found[f"{name}:fp32"] = dataclasses.replace(found[name], module=copy.deepcopy(found[name].module))
        for name, k in list(bundle_k.items()):  # a bundle's fp32 twin runs at the bundle's k too
            if name.replace(TREE_SUFFIX, "", 1) in int8:
                bundle_k[f"{name}:fp32"] = k
    tok = target.tokenizer
    data = load_chat_data(cfg.data, tok)
    convs = data.conversations[: ev.max_prompts]
    models = {name: d.module for name, d in found.items() if isinstance(d.module, torch.nn.Module)}
    separate = {name: m for name, m in models.items() if found[name].kind.trained_by == "distill"}
    hf_model, hf_drafts = prepare_for_decoding(
        target.model, separate, layout=ev.decode_layout, compare_hf=ev.compare_hf,
        heads={name: m for name, m in models.items() if name not in separate}, int8=tuple(int8))
    graphs = use_graphs(ev.cuda_graphs, target.device.type, target.split, "eval")
    settings = Settings(model=target.model, tokenizer=tok, eos_ids=set(eos_token_ids(target.generation_config, tok)),
                        max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, top_p=ev.top_p,
                        seed=cfg.seed, hf_model=hf_model, drafting=DraftOptions(
                            ngram_max=ev.ngram_max, ngram_min=ev.ngram_min, tree_depth=ev.tree_depth,
                            tree_topk=ev.tree_topk, medusa_choices=ev.medusa_choices,
                            confidence_threshold=ev.confidence_threshold), graphs=graphs)
    greedy = ev.temperature == 0
    num_turns = sum(min(len(c.user_turns), cfg.data.max_turns or 99) for c in convs)
    spec = method_list(found, ev.trees and not ev.engine)
    sweep_of = lambda name: ev.tree_budgets if kind_of_method(name)[1] else ev.sweep
    log.info("eval: %d conversations (%d turns) from %s; methods plain, hf_generate, %s",
             len(convs), num_turns, cfg.data.source, ", ".join(n for n, _, _ in spec) or "no drafters")

    def method(drafter: str, k: Optional[int] = None, draft=None) -> Method:
        return Method(make_decode(drafter, settings, k, draft), drafter, k)

    def run_methods(methods: dict[str, Method], conversations, max_turns, desc: str,
                    batch_size: int = ev.batch_size) -> dict[str, Measurement]:
        turns = sum(min(len(c.user_turns), max_turns or 99) for c in conversations)
        with tqdm(total=turns * len(methods), desc=desc, unit="turn", dynamic_ncols=True) as bar:
            results = measure(methods, conversations, settings, batch_size=batch_size, max_turns=max_turns,
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

    if ev.fixed_num_draft_tokens is not None:
        chosen = {name: ev.fixed_num_draft_tokens for name, _, _ in spec}
    else:
        chosen = {name: k for name, k in bundle_k.items() if name in {n for n, _, _ in spec}}
    swept_spec = [(name, drafter, draft) for name, drafter, draft in spec if name not in chosen]
    # What each method may run at: the costs of all of them are timed together, before any decoding.
    budgets = {name: sweep_of(name) if name not in chosen else [chosen[name]] for name, _, _ in spec}
    ks = sorted({k for values in budgets.values() for k in values} | set(ev.sweep))
    costs = measure_costs(settings.target, spec, ks, budgets, ev)

    sweeps = {}
    if swept_spec:
        candidates = {"plain": method("plain")}
        candidates.update({f"{name} k={k}": method(drafter, k, draft) for name, drafter, draft in swept_spec
                           for k in sweep_of(name)})
        swept = run_methods(candidates, convs[: ev.sweep_prompts], cfg.data.max_turns, "eval sweep")
        base = swept["plain"].total.tokens_per_s
        for name, drafter, _ in swept_spec:
            rows = []
            for k in sweep_of(name):
                m = swept[f"{name} k={k}"]
                rows.append(dict(num_draft_tokens=k, tau=m.total.tau, acceptance_by_position=m.acceptance_by_position,
                                 tokens_per_s=m.total.tokens_per_s, speedup_vs_plain=m.total.tokens_per_s / base,
                                 proposal_rate=m.proposal_rate,
                                 predicted_speedup=costs.predicted(name, m, k, ev.confidence_threshold)))
            sweeps[name] = rows
            chosen[name] = best_num_draft_tokens(rows)

    final = {"plain": method("plain"), "hf_generate": method("hf_generate")}
    hf_names = {}
    for name, drafter, draft in spec:
        final[name] = method(drafter, chosen[name], draft)
        if ev.compare_hf and drafter in HF_EQUIVALENT:
            hf_names[name] = HF_EQUIVALENT[drafter] + name[len(drafter):]
            final[hf_names[name]] = method(HF_EQUIVALENT[drafter], chosen[name], hf_drafts.get(name))
    results = run_methods(final, convs, cfg.data.max_turns, "eval")
    plain, hf = results["plain"], results["hf_generate"]
    by_batch_size = {}
    for size in ev.batch_sizes:
        ours = {name: m for name, m in final.items() if name != "hf_generate" and name not in hf_names.values()}
        measured = run_methods(ours, convs, cfg.data.max_turns, f"eval batch {size}", batch_size=size)
        base = measured["plain"].total.tokens_per_s
        by_batch_size[str(size)] = {name: dict(tokens_per_s=m.total.tokens_per_s, tau=m.total.tau,
                                               speedup_vs_plain=m.total.tokens_per_s / base)
                                    for name, m in measured.items()}

    methods = {"plain": {**summary(plain, plain, hf), "drafter": "none", "lossless": True}}
    hf_methods = {}
    for name, drafter, draft in spec:
        k, m = chosen[name], results[name]
        entry = summary(m, plain, hf)
        entry["num_draft_tokens_mode"] = ("auto" if name in sweeps
                                          else "fixed" if ev.fixed_num_draft_tokens is not None else "bundle")
        entry["proposal_rate"] = m.proposal_rate
        entry["predicted_speedup"] = costs.predicted(name, m, k, ev.confidence_threshold)
        entry["draft_cost_ratio"] = costs.draft.get(name.replace(TREE_SUFFIX, ""), 0.0)
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
        tie_epsilon=tie_epsilon(next(target.model.parameters()).dtype),
        confidence_threshold=ev.confidence_threshold, int8_drafts=[n for n in int8 if is_int8(models[n])],
        cuda_graphs=graphs,
        baselines=dict(plain=dict(tokens_per_s=plain.total.tokens_per_s, tokens=plain.total.tokens,
                                  seconds=plain.total.seconds),
                       hf_generate=dict(tokens_per_s=hf.total.tokens_per_s, tokens=hf.total.tokens,
                                        seconds=hf.total.seconds,
                                        **losslessness(target.model, plain, hf, greedy, "hf_generate"))),
        methods=methods, sweeps=sweeps, hf_methods=hf_methods, costs=costs.report(), by_batch_size=by_batch_size,
        skipped_records=dict(data.skipped),
    )
    if ev.engine:
        report["engines"] = {ev.engine: engine_check(cfg, target, convs, results, report, settings)}
    images = write_report(report, out)

    tracker = start_tracker(cfg.logger.kind, run_name=cfg.run, stage=STAGE, config=dataclasses.asdict(cfg),
                            log_dir=out.parent, project=cfg.logger.project, entity=cfg.logger.entity, mode=cfg.logger.mode)
    tracker.log({f"eval/{name}/{key}": value for name, m in methods.items()
                 for key, value in m.items() if isinstance(value, (int, float)) and not isinstance(value, bool)})
    tracker.log_images({f"eval/{name}": path for name, path in images.items()})
    tracker.finish()

    inputs = dict(d.inputs for d in found.values() if d.inputs is not None)
    if ev.bundle:
        inputs["bundle"] = {"path": str(Path(ev.bundle).expanduser())}
    write_manifest(out, stage=STAGE, config=dataclasses.asdict(cfg), target_fingerprint=report["target"]["fingerprint"],
                   outputs={k: v for k, v in hash_tree(out).items() if k != MANIFEST},
                   wall_time_s=time.perf_counter() - t0, inputs=inputs)
    print(f"eval: {len(methods)} methods on {len(convs)} conversations -> {out / 'report.md'}")
    print(_console_table(report))
    if ev.engine:
        from pipeline.eval.engine import table

        print(table(report["engines"][ev.engine]))
    return out


def engine_check(cfg: Config, target: Target, convs, results: dict[str, Measurement], report: dict,
                 settings: Settings) -> dict:
    """eval.engine=llama.cpp: the bundle served by llama.cpp (eval/engine.py) beside our decoder's
    numbers for it, also recorded in the bundle's bundle.json (engines)."""
    from pipeline.eval.engine import check_llama_cpp
    from pipeline.export.bundle import load_bundle, record_engine

    # Loaded again: find_drafts' copy of the draft was prepared for our decoder (int8, the CPU
    # layout); the replay runs it as the engine does, from its own weights.
    bundle = load_bundle(cfg.eval.bundle, target)
    name = next((n for n in (f"{bundle.method}:bundle", bundle.method) if n in report["methods"]), None)
    plain = results["plain"]
    ours = dict(tau=report["methods"][name]["tau"] if name else None,
                plain={tuple(ctx): out for c in convs for ctx, out in zip(plain.contexts[c.id], plain.outputs[c.id])})
    result = check_llama_cpp(bundle, target, convs, cfg.data.max_turns, cfg.eval.max_new_tokens, settings.eos_ids,
                             cfg.eval.engine_repeats, ours)
    record_engine(bundle.path, cfg.eval.engine, result)
    return result


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
