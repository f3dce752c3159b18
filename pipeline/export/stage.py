"""The export stage: write the run's distilled draft, its trained heads, or prompt lookup as a
bundle (see bundle.py), with the numbers eval measured for it.

Inputs: the trained stage of the kind exported (`runs/<run>/distill/` for draft_model,
`runs/<run>/heads/<kind>/` for medusa, eagle, early_exit; none for ngram) and `runs/<run>/eval/`
(the measured tau and speedup, which the bundle records), all finished, all for the same
target, and each still the one its successor read (manifest hashes, runs.check_consumed): a
stage run again since is named with the command to re-run after it. bundle.json records those
hashes (provenance). export.method=auto exports the fastest lossless method eval measured.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from pipeline.config import TIMING_NOISE, Config
from pipeline.errors import PipelineError
from pipeline.export.bundle import BUNDLE_JSON, CHECKSUMS, FORMAT_VERSION, write_checksums
from pipeline.export.gguf import GGUF_DIR, source_gguf, why_not, write_gguf
from pipeline.files import MARKER, atomic_dir, remove
from pipeline.kinds import KINDS, Kind, kind_of_method
from pipeline.runs import (
    check_consumed, check_trained, manifest_sha, package_versions, read_manifest, run_dir, stage_dir,
)

log = logging.getLogger(__name__)
STAGE = "export"


def exportable(report: dict) -> dict[str, dict]:
    """The methods of the run that a bundle can hold (a kind, or a kind's tree), losslessly measured."""
    return {name: m for name, m in report.get("methods", {}).items()
            if name != "plain" and ":" not in name and m.get("lossless") is not False}


def choose_method(report: dict, eval_dir: Path, method: str) -> str:
    """The eval method to export: export.method, or for auto the fastest of `exportable`."""
    if method != "auto":
        return method
    candidates = exportable(report)
    if not candidates:
        raise PipelineError(f"{eval_dir / 'report.json'} has no lossless method to export: train a draft "
                            "(stage=distill or stage=heads) and run stage=eval, or measure prompt lookup (eval.ngram)")
    return max(candidates, key=lambda name: candidates[name]["speedup_vs_plain"])


def check_measured(report: dict, eval_dir: Path, name: str, kind: Kind, run: str) -> None:
    if name not in report.get("methods", {}):
        how = "with eval.ngram=true" if kind.trained_by is None else f"after `{kind.train_command(run)}`"
        raise PipelineError(f"{eval_dir / 'report.json'} has no {name} method: run "
                            f"`python -m pipeline stage=eval run={run}` {how}")


def _data_summary(generate_dir: Path) -> Optional[dict]:
    if not (generate_dir / "manifest.json").is_file():
        return None
    gm = read_manifest(generate_dir, "generate")
    data = gm.get("config", {}).get("data", {})
    gen = gm.get("config", {}).get("generate", {})
    return dict(source=data.get("source"), path=data.get("path"), limit=data.get("limit"),
                max_turns=data.get("max_turns"), conversations=gm.get("num_conversations"),
                generated_tokens=gm.get("num_generated_tokens"),
                scored_source_tokens=gm.get("num_scored_source_tokens", 0),
                max_new_tokens=gen.get("max_new_tokens"), temperature=gen.get("temperature"),
                topk_logits=gen.get("save_topk_logits"))


def bundle_meta(run: str, name: str, train_manifest: Optional[dict], report: dict, eval_config: dict,
                data: Optional[dict], formats: dict) -> dict[str, Any]:
    """bundle.json for the eval method `name` (a kind or its tree); train_manifest: the manifest of
    the stage that trained it (None for ngram)."""
    kind, tree = kind_of_method(name)
    method = report["methods"][name]
    metrics = (train_manifest or {}).get("metrics", {})
    config = (train_manifest or {}).get("config", {})
    if kind.trained_by is None:
        draft = dict(kind=kind.name, ngram_max=eval_config.get("ngram_max"), ngram_min=eval_config.get("ngram_min"))
        loss = None
    elif kind.trained_by == "distill":
        draft_cfg = config.get("draft", {})
        draft = dict(folder=kind.bundle_folder, kind=draft_cfg.get("kind"), num_layers=draft_cfg.get("num_layers"),
                     init_layers=draft_cfg.get("init_layers"), draft_vocab_size=metrics.get("draft_vocab_size"))
        loss = config.get("distill", {}).get("loss")
    else:
        heads_cfg = config.get("heads", {})
        draft = dict(folder=kind.bundle_folder, kind=kind.name, draft_vocab_size=metrics.get("draft_vocab_size"),
                     **{k: heads_cfg.get(k) for k in kind.settings})
        loss = heads_cfg.get("loss")
    training = None if train_manifest is None else dict(
        run=run, data=data, steps=metrics.get("steps"), loss=loss,
        heldout_alpha_start=metrics.get("heldout_alpha_start"), heldout_alpha_end=metrics.get("heldout_alpha_end"),
        wall_time_s=metrics.get("wall_time_s"))
    return {
        "format_version": FORMAT_VERSION,
        "method": kind.name,
        "tree": tree,
        "num_draft_tokens": method["num_draft_tokens"],
        "target": dict(name=report["target"]["name"], fingerprint=report["target"]["fingerprint"]),
        "draft": draft,
        "measured": dict(
            method=name, dataset=report["dataset"], num_prompts=report["num_prompts"], num_turns=report["num_turns"],
            max_new_tokens=report["max_new_tokens"], temperature=report["temperature"], device=report["device"],
            dtype=report["dtype"], threads=report.get("threads"), tau=method["tau"],
            acceptance_by_position=method["acceptance_by_position"], tokens_per_s=method["tokens_per_s"],
            plain_tokens_per_s=report["baselines"]["plain"]["tokens_per_s"],
            speedup_vs_plain=method["speedup_vs_plain"], speedup_vs_hf=method.get("speedup_vs_hf"),
            draft_cost_ratio=method.get("draft_cost_ratio"), lossless=method.get("lossless"),
        ),
        "training": training,
        "formats": formats,
        "package_versions": package_versions(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _describe(meta: dict) -> str:
    d, kind = meta["draft"], KINDS[meta["method"]]
    what = f"{d['num_layers']}-layer {d['kind']} draft model" if kind.trained_by == "distill" else kind.describe
    return what + (f", verified as a token tree of {meta['num_draft_tokens']} nodes" if meta.get("tree") else "")


def _use_lines(meta: dict) -> list[str]:
    formats, kind, d = meta["formats"], KINDS[meta["method"]], meta["draft"]
    k = meta["num_draft_tokens"]
    if kind.trained_by is None:
        return [f"- specdraft: `stage=eval eval.bundle=<path>` (prompt lookup of the last {d['ngram_max']} down to "
                f"{d['ngram_min']} tokens, {k} draft tokens).",
                f"- vLLM: `speculative_config={{\"method\": \"ngram\", \"num_speculative_tokens\": {k}, "
                f"\"prompt_lookup_max\": {d['ngram_max']}, \"prompt_lookup_min\": {d['ngram_min']}}}`; "
                f"transformers: `generate(..., prompt_lookup_num_tokens={k})`."]
    if kind.trained_by == "distill":
        folder = kind.bundle_folder
        return [f"- `{folder}/` is a plain transformers model folder (safetensors): "
                f"`target.generate(..., assistant_model=AutoModelForCausalLM.from_pretrained('{folder}'))`, or the "
                "draft model of vLLM / SGLang speculative decoding with this target.",
                f"- specdraft: `load_bundle(path, target)` or `stage=eval eval.bundle=<path>`; it also reads "
                f"`{folder}/draft_vocab.safetensors` (the tokens the draft proposes) when present."]
    lines = [f"- specdraft: `load_bundle(path, target)` or `stage=eval eval.bundle=<path>` load "
             f"`{kind.bundle_folder}/` (the trained weights and draft vocabulary; the rest is the target's own)."]
    if "medusa" in formats:
        lines.append(f"- `{formats['medusa']}/`: the Medusa-1 layout (`config.json` with `medusa_num_heads`, "
                     "`medusa_num_layers`, `base_model_name_or_path`; `medusa_lm_head.safetensors`).")
    if "eagle3" in formats:
        lines.append(f"- `{formats['eagle3']}/`: the EAGLE-3 layout (`config.json` with architectures "
                     "`LlamaForCausalLMEagle3`, `draft_vocab_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`; "
                     "`model.safetensors` with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) that EAGLE's "
                     "code, SGLang and vLLM read, with the target as the base model.")
    if "speculators" in formats:
        lines.append(f"- `{formats['speculators']}/`: the same head in the speculators layout "
                     "(`speculators_model_type: eagle3`, read by vLLM's speculators support and by the "
                     "speculators library; the target is `speculators_config.verifier.name_or_path`).")
    return lines


def _llama_cpp_lines(meta: dict) -> list[str]:
    engine = meta.get("llama_cpp") or {}
    if engine.get("command"):
        return [f"- llama.cpp: `{engine['command']}` (from this folder; `{engine['draft']}` converted by llama.cpp's "
                f"own converter at {engine['outtype']}, `{engine['target']}` {engine['target_from']})."]
    return [f"- llama.cpp: no `gguf/`: {engine['skipped']}."] if engine.get("skipped") else []


def _training_lines(meta: dict) -> list[str]:
    training = meta["training"]
    if training is None:
        return ["## Training", "", "None: prompt lookup copies from the context and needs no weights.", ""]
    data = training.get("data") or {}
    return [
        "## Training",
        "",
        f"{training['steps']} steps, loss {training['loss']}; held-out expected acceptance "
        f"{_num(training['heldout_alpha_start'])} -> {_num(training['heldout_alpha_end'])}. "
        f"Data: {data.get('conversations', '?')} conversations of {data.get('source', '?')}, "
        f"{data.get('generated_tokens', '?')} tokens regenerated by the target"
        f"{', ' + str(data['scored_source_tokens']) + ' source tokens scored by it' if data.get('scored_source_tokens') else ''}.",
        "",
    ]


def model_card(meta: dict) -> str:
    m, t = meta["measured"], meta["target"]
    accept = ", ".join(f"{a:.2f}" for a in m["acceptance_by_position"])
    hf = f" ({m['speedup_vs_hf']:.2f}x HF `generate`)" if m.get("speedup_vs_hf") else ""
    return "\n".join([
        f"# Draft for {t['name']}",
        "",
        f"A speculative-decoding draft ({_describe(meta)}) made by specdraft "
        f"for **{t['name']}** (fingerprint `{t['fingerprint'][:16]}`). Use it with that target only: "
        "`pipeline.export.load_bundle` refuses any other.",
        "",
        "## Measured (specdraft eval)",
        "",
        f"| {'tree nodes' if meta.get('tree') else 'num_draft_tokens'} | tau | acceptance by position | tokens/s | vs plain | draft/target cost | lossless |",
        "|---:|---:|---|---:|---:|---:|---|",
        f"| {meta['num_draft_tokens']} | {m['tau']:.2f} | {accept} | {m['tokens_per_s']:.2f} | "
        f"{m['speedup_vs_plain']:.2f}x{hf} | {m['draft_cost_ratio'] or 0:.3f} | {m['lossless']} |",
        "",
        f"On {m['dataset']} ({m['num_prompts']} conversations, {m['num_turns']} turns, {m['max_new_tokens']} new "
        f"tokens, temperature {m['temperature']}), {m['dtype']} on {m['device']}"
        f"{', ' + str(m['threads']) + ' threads' if m.get('threads') else ''}; plain decoding "
        f"{m['plain_tokens_per_s']:.2f} tokens/s. Speed depends on the machine: measure again on yours "
        "(`python -m pipeline stage=eval eval.bundle=<this folder>`).",
        "",
        *_training_lines(meta),
        "## Use",
        "",
        *_use_lines(meta),
        *_llama_cpp_lines(meta),
        f"- `{CHECKSUMS}`: `sha256sum -c {CHECKSUMS}` checks every file.",
        "",
    ])


def _num(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def bundle_dir(cfg: Config) -> Path:
    """Where the bundle goes: export.dir, which may not be, hold or lie inside the run's own folder
    (runs/<run>/export, the default, aside)."""
    default = stage_dir(cfg.runs_dir, cfg.run, STAGE)
    if not cfg.export.dir:
        return default
    out = Path(cfg.export.dir).expanduser()
    run_folder = run_dir(cfg.runs_dir, cfg.run).resolve()
    chosen = out.resolve()
    if chosen != default.resolve() and (chosen == run_folder or run_folder.is_relative_to(chosen)
                                        or chosen.is_relative_to(run_folder)):
        raise PipelineError(f"export.dir={cfg.export.dir} is inside or above the run folder {run_folder}, whose "
                            "stages it would replace; choose a folder outside it (or leave export.dir unset)")
    return out


def is_bundle(folder: Path) -> bool:
    """A bundle from before markers: it holds bundle.json and the checksum list."""
    return (folder / BUNDLE_JSON).is_file() and (folder / CHECKSUMS).is_file()


def run(cfg: Config) -> Path:
    t0 = time.perf_counter()
    generate_dir = stage_dir(cfg.runs_dir, cfg.run, "generate")
    eval_dir = stage_dir(cfg.runs_dir, cfg.run, "eval")
    eval_manifest = read_manifest(eval_dir, "eval", cfg.run)
    report = json.loads((eval_dir / "report.json").read_text())
    name = choose_method(report, eval_dir, cfg.export.method)
    kind, tree = kind_of_method(name)
    provenance = {"eval": manifest_sha(eval_dir)}
    train_dir, train_manifest = None, None
    if kind.trained_by is not None:
        extra = f"heads={kind.name}" if kind.trained_by == "heads" else ""
        train_dir = kind.trained_folder(cfg.runs_dir, cfg.run)
        train_manifest = read_manifest(train_dir, kind.trained_by, cfg.run, extra=extra)
        check_trained(train_manifest, train_dir, generate_dir, cfg.run, extra)
        # The numbers the bundle carries were measured on this very draft, not on an earlier one.
        train_key = "distill" if kind.trained_by == "distill" else f"heads/{kind.name}"
        check_consumed(eval_manifest, train_key, train_dir, who=eval_dir,
                       rerun=f"python -m pipeline stage=eval run={cfg.run}")
        if train_manifest["target_fingerprint"] != report["target"]["fingerprint"]:
            raise PipelineError(f"{eval_dir} measured another target than the one {train_dir} was trained for; "
                                f"run `python -m pipeline stage=eval run={cfg.run}` again")
        provenance.update({"generate": manifest_sha(generate_dir), train_key: manifest_sha(train_dir)})
    check_measured(report, eval_dir, name, kind, cfg.run)
    formats = {"specdraft_" + kind.bundle_folder: kind.bundle_folder} if kind.bundle_folder else {}
    if kind.trained_by == "distill":
        formats = {"hf_draft": kind.bundle_folder}
    data = _data_summary(generate_dir) if train_manifest is not None else None
    meta = bundle_meta(cfg.run, name, train_manifest, report, eval_manifest.get("config", {}).get("eval", {}), data,
                       formats)
    meta["provenance"] = provenance

    out = bundle_dir(cfg)
    with atomic_dir(out, "bundle", hint="choose another export.dir=<folder>", adopt=is_bundle) as tmp:
        write_draft(kind, tree, train_dir, tmp, cfg, meta)
        (tmp / "eval").mkdir()
        for f in sorted(eval_dir.iterdir()):
            if f.is_file() and (f.suffix == ".png" or f.name in ("report.json", "report.md")):
                shutil.copy2(f, tmp / "eval" / f.name)
        (tmp / BUNDLE_JSON).write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(meta))
        write_checksums(tmp)
    log.info("export: bundle written in %.1fs", time.perf_counter() - t0)
    print(f"export: bundle -> {out}")
    engine = meta.get("llama_cpp") or {}
    if engine.get("command"):
        print(f"  llama.cpp: {engine['command']}")
    elif engine.get("skipped"):
        print(f"  llama.cpp: no gguf/ ({engine['skipped']})")
    if cfg.export.method == "auto":
        print(methods_table(report, name))
    else:
        m = meta["measured"]
        print(f"  {'method':<16} {'k':>3} {'tau':>6} {'tok/s':>8} {'vs plain':>9} {'draft cost':>11}")
        print(f"  {name:<16} {meta['num_draft_tokens']:>3} {m['tau']:>6.2f} {m['tokens_per_s']:>8.2f} "
              f"{m['speedup_vs_plain']:>8.2f}x {m['draft_cost_ratio'] or 0:>11.3f}")
    return out


def write_draft(kind: Kind, tree: bool, train_dir: Optional[Path], folder: Path, cfg: Config, meta: dict) -> None:
    """The draft's own files in the bundle folder, the engine layouts its kind writes, and gguf/
    for llama.cpp where it runs the method (export.gguf)."""
    from pipeline.models import EMBEDDED_TARGETS, load_target

    if kind.trained_by == "distill":
        shutil.copytree(train_dir / kind.weights, folder / kind.bundle_folder, ignore=shutil.ignore_patterns(MARKER))
    elif kind.trained_by == "heads":
        (folder / kind.bundle_folder).mkdir()
        for f in ("heads.safetensors", "heads_config.json"):
            shutil.copy2(train_dir / f, folder / kind.bundle_folder / f)
    target = module = None
    if kind.formats is not None:
        target = load_target(**dataclasses.asdict(cfg.target))
        module = kind.load(train_dir / kind.weights, target)
        # What a serving stack loads as the base model: an embedded target is the HF folder
        # converted from its GGUF (dequantized weights: not the hub model of the same name).
        base = str(target.folder) if target.name in EMBEDDED_TARGETS else target.name
        meta["formats"].update(kind.formats(module, target, base, meta["num_draft_tokens"], folder))
    if cfg.export.gguf is False:
        return
    if target is None and kind.trained_by is not None:
        target = load_target(**dataclasses.asdict(cfg.target), weights=False)
    reason = why_not(kind.name, tree, module, target.model.config if target and target.model else None)
    if reason is None:
        source = folder / (kind.bundle_folder if kind.trained_by == "distill" else meta["formats"]["eagle3"])
        try:
            meta["llama_cpp"] = write_gguf(kind.name, folder, source, target,
                                           source_gguf(cfg.target.name_or_path, cfg.target.gguf_file),
                                           cfg.export.gguf_outtype, meta["num_draft_tokens"])
            meta["formats"]["gguf"] = GGUF_DIR
            return
        except PipelineError as e:
            remove(folder / GGUF_DIR)
            reason = str(e)
    if cfg.export.gguf:
        raise PipelineError(f"export.gguf=true: {reason}")
    meta["llama_cpp"] = dict(skipped=reason)  # run() prints it


def methods_table(report: dict, exported: str) -> str:
    """Every method eval measured against plain decoding, the one exported named, and when none
    beats plain, why in one line and what gets a faster draft."""
    plain = report["baselines"]["plain"]["tokens_per_s"]
    rows = [f"  {'method':<22} {'k':>3} {'tau':>6} {'tok/s':>8} {'vs plain':>9}",
            f"  {'plain':<22} {'–':>3} {'1.00':>6} {plain:>8.2f} {'1.00x':>9}"]
    for name, m in report["methods"].items():
        if name == "plain":
            continue
        tau = f"{m['tau']:.2f}" if m["tau"] else "–"
        mark = "  <- fastest, exported" if name == exported else ""
        rows.append(f"  {name:<22} {m['num_draft_tokens']:>3} {tau:>6} {m['tokens_per_s']:>8.2f} "
                    f"{m['speedup_vs_plain']:>8.2f}x{mark}")
    best = report["methods"][exported]
    if best["speedup_vs_plain"] < 1.0 + TIMING_NOISE:  # closer to plain than timing noise: not faster
        k = best["num_draft_tokens"]
        costs = report.get("costs", {})
        verify = costs.get("verify_cost_by_k", {}).get(str(k))
        cost = (f": a pass yields {best['tau']:.2f} tokens but costs {verify:.2f} target forwards to verify "
                f"{k + 1} tokens" + (f" plus {k * best['draft_cost_ratio']:.2f} to draft them"
                                     if best.get("draft_cost_ratio") else "")) if verify and best["tau"] else ""
        rows.append(f"  no method beats plain decoding by more than timing noise on this machine (fastest {exported}, "
                    f"{best['speedup_vs_plain']:.2f}x){cost}; a trained draft accepts more: "
                    "`python -m pipeline stage=all experiment=recipe_cpu` (see docs/)")
    else:
        rows.append(f"  fastest: {exported}, {best['speedup_vs_plain']:.2f}x plain decoding")
    return "\n".join(rows)
