"""The export stage: write the run's distilled draft, or its trained heads, as a bundle (see
bundle.py).

Inputs: `runs/<run>/distill/` (export.method=draft_model) or `runs/<run>/heads/<kind>/`
(export.method=medusa|eagle|early_exit), and `runs/<run>/eval/` (the measured tau and
speedup, which the bundle records), all finished, all for the same target, and each still the
one its successor read (manifest hashes, runs.check_consumed): a stage run again since is
named with the command to re-run after it. bundle.json records those hashes (provenance).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.export.bundle import BUNDLE_JSON, CHECKSUMS, DRAFT_DIR, FORMAT_VERSION, HEADS_DIR, write_checksums
from pipeline.export.formats import EAGLE3_DIR, MEDUSA_DIR, SPECULATORS_DIR, write_eagle3, write_medusa, write_speculators
from pipeline.files import MARKER, atomic_dir
from pipeline.runs import (
    check_consumed, check_trained, manifest_sha, package_versions, read_manifest, run_dir, stage_dir,
)

log = logging.getLogger(__name__)
STAGE = "export"


def _method_report(report: dict, eval_dir: Path, name: str) -> dict:
    method = report.get("methods", {}).get(name)
    if method is None:
        where = "runs/<run>/distill" if name == "draft_model" else f"runs/<run>/heads/{name}"
        raise PipelineError(f"{eval_dir / 'report.json'} has no {name} method: run the eval stage after training "
                            f"in the same run (it finds the draft in {where})")
    return method


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


def bundle_meta(run: str, train_manifest: dict, report: dict, method: dict, data: Optional[dict],
                name: str = "draft_model", formats: Optional[dict] = None) -> dict[str, Any]:
    """bundle.json: `name` is draft_model (train_manifest: distill's) or a heads kind (heads')."""
    metrics = train_manifest.get("metrics", {})
    config = train_manifest.get("config", {})
    if name == "draft_model":
        draft_cfg = config.get("draft", {})
        draft = dict(folder=DRAFT_DIR, kind=draft_cfg.get("kind"), num_layers=draft_cfg.get("num_layers"),
                     init_layers=draft_cfg.get("init_layers"), draft_vocab_size=metrics.get("draft_vocab_size"))
        loss = config.get("distill", {}).get("loss")
    else:
        heads_cfg = config.get("heads", {})
        draft = dict(folder=HEADS_DIR, kind=name, draft_vocab_size=metrics.get("draft_vocab_size"),
                     **{k: heads_cfg.get(k) for k in _HEAD_KEYS[name]})
        loss = heads_cfg.get("loss")
    return {
        "format_version": FORMAT_VERSION,
        "method": name,
        "num_draft_tokens": method["num_draft_tokens"],
        "target": dict(name=report["target"]["name"], fingerprint=report["target"]["fingerprint"]),
        "draft": draft,
        "measured": dict(
            dataset=report["dataset"], num_prompts=report["num_prompts"], num_turns=report["num_turns"],
            max_new_tokens=report["max_new_tokens"], temperature=report["temperature"], device=report["device"],
            dtype=report["dtype"], threads=report.get("threads"), tau=method["tau"],
            acceptance_by_position=method["acceptance_by_position"], tokens_per_s=method["tokens_per_s"],
            plain_tokens_per_s=report["baselines"]["plain"]["tokens_per_s"],
            speedup_vs_plain=method["speedup_vs_plain"], speedup_vs_hf=method.get("speedup_vs_hf"),
            draft_cost_ratio=method.get("draft_cost_ratio"), lossless=method.get("lossless"),
        ),
        "training": dict(run=run, data=data, steps=metrics.get("steps"), loss=loss,
                         heldout_alpha_start=metrics.get("heldout_alpha_start"),
                         heldout_alpha_end=metrics.get("heldout_alpha_end"), wall_time_s=metrics.get("wall_time_s")),
        "formats": formats or {"hf_draft": DRAFT_DIR},
        "package_versions": package_versions(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


_HEAD_KEYS = {"medusa": ("medusa_num_heads", "medusa_num_layers"), "eagle": ("feature_layers", "ttt_steps"),
              "early_exit": ("exit_layer", "adapter_rank")}
_DESCRIBE = {"medusa": "Medusa heads", "eagle": "EAGLE head", "early_exit": "early-exit adapter"}


def _describe(meta: dict) -> str:
    d = meta["draft"]
    if meta["method"] == "draft_model":
        return f"{d['num_layers']}-layer {d['kind']} draft model"
    return f"{_DESCRIBE[meta['method']]} on the target's own hidden states"


def _use_lines(meta: dict) -> list[str]:
    formats = meta["formats"]
    if meta["method"] == "draft_model":
        return [f"- `{DRAFT_DIR}/` is a plain transformers model folder (safetensors): "
                f"`target.generate(..., assistant_model=AutoModelForCausalLM.from_pretrained('{DRAFT_DIR}'))`, or the "
                "draft model of vLLM / SGLang speculative decoding with this target.",
                f"- specdraft: `load_bundle(path, target)` or `stage=eval eval.bundle=<path>`; it also reads "
                f"`{DRAFT_DIR}/draft_vocab.safetensors` (the tokens the draft proposes) when present."]
    lines = [f"- specdraft: `load_bundle(path, target)` or `stage=eval eval.bundle=<path>` load `{HEADS_DIR}/` "
             "(the trained weights and draft vocabulary; the rest is the target's own)."]
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


def model_card(meta: dict) -> str:
    m, t, d = meta["measured"], meta["target"], meta["draft"]
    data = meta["training"].get("data") or {}
    accept = ", ".join(f"{a:.2f}" for a in m["acceptance_by_position"])
    hf = f" ({m['speedup_vs_hf']:.2f}x HF `generate`)" if m.get("speedup_vs_hf") else ""
    return "\n".join([
        f"# Draft for {t['name']}",
        "",
        f"A speculative-decoding draft ({_describe(meta)}) trained by specdraft "
        f"to match **{t['name']}** (fingerprint `{t['fingerprint'][:16]}`). Use it with that target only: "
        "`pipeline.export.load_bundle` refuses any other.",
        "",
        "## Measured (specdraft eval)",
        "",
        "| num_draft_tokens | tau | acceptance by position | tokens/s | vs plain | draft/target cost | lossless |",
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
        "## Training",
        "",
        f"{meta['training']['steps']} steps, loss {meta['training']['loss']}; held-out expected acceptance "
        f"{_num(meta['training']['heldout_alpha_start'])} -> {_num(meta['training']['heldout_alpha_end'])}. "
        f"Data: {data.get('conversations', '?')} conversations of {data.get('source', '?')}, "
        f"{data.get('generated_tokens', '?')} tokens regenerated by the target"
        f"{', ' + str(data['scored_source_tokens']) + ' source tokens scored by it' if data.get('scored_source_tokens') else ''}.",
        "",
        "## Use",
        "",
        *_use_lines(meta),
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
    name = cfg.export.method
    generate_dir = stage_dir(cfg.runs_dir, cfg.run, "generate")
    if name == "draft_model":
        train_key, train_dir = "distill", stage_dir(cfg.runs_dir, cfg.run, "distill")
        train_manifest = read_manifest(train_dir, "distill", cfg.run)
        check_trained(train_manifest, train_dir, generate_dir, cfg.run)
    else:
        train_key, train_dir = f"heads/{name}", stage_dir(cfg.runs_dir, cfg.run, "heads") / name
        train_manifest = read_manifest(train_dir, "heads", cfg.run, extra=f"heads={name}")
        check_trained(train_manifest, train_dir, generate_dir, cfg.run, f"heads={name}")
    eval_dir = stage_dir(cfg.runs_dir, cfg.run, "eval")
    eval_manifest = read_manifest(eval_dir, "eval", cfg.run)
    report = json.loads((eval_dir / "report.json").read_text())
    method = _method_report(report, eval_dir, name)
    # The numbers the bundle carries were measured on this very draft, not on an earlier one.
    check_consumed(eval_manifest, train_key, train_dir, who=eval_dir, rerun=f"python -m pipeline stage=eval run={cfg.run}")
    if train_manifest["target_fingerprint"] != report["target"]["fingerprint"]:
        raise PipelineError(f"{eval_dir} measured another target than the one {train_dir} was trained for; "
                            f"run `python -m pipeline stage=eval run={cfg.run}` again")
    formats = {"hf_draft": DRAFT_DIR} if name == "draft_model" else {"specdraft_heads": HEADS_DIR}
    if name == "medusa":
        formats["medusa"] = MEDUSA_DIR
    if name == "eagle":
        formats.update(eagle3=EAGLE3_DIR, speculators=SPECULATORS_DIR)
    meta = bundle_meta(cfg.run, train_manifest, report, method, _data_summary(generate_dir), name, formats)
    meta["provenance"] = {"generate": manifest_sha(generate_dir), train_key: manifest_sha(train_dir),
                          "eval": manifest_sha(eval_dir)}

    out = bundle_dir(cfg)
    with atomic_dir(out, "bundle", hint="choose another export.dir=<folder>", adopt=is_bundle) as tmp:
        if name == "draft_model":
            shutil.copytree(train_dir / "checkpoint", tmp / DRAFT_DIR, ignore=shutil.ignore_patterns(MARKER))
        else:
            (tmp / HEADS_DIR).mkdir()
            for f in ("heads.safetensors", "heads_config.json"):
                shutil.copy2(train_dir / f, tmp / HEADS_DIR / f)
        if name in ("medusa", "eagle"):
            from pipeline.heads.models import load_heads
            from pipeline.models import EMBEDDED_TARGETS, load_target

            target = load_target(**dataclasses.asdict(cfg.target))
            heads = load_heads(train_dir, target.model)
            # What a serving stack loads as the base model: an embedded target is the HF folder
            # converted from its GGUF (dequantized weights: not the hub model of the same name).
            base = str(target.folder) if target.name in EMBEDDED_TARGETS else target.name
            if name == "medusa":
                write_medusa(heads, target.model, base, tmp / MEDUSA_DIR)
            else:
                write_eagle3(heads, target.model, tmp / EAGLE3_DIR)
                write_speculators(heads, target.model, base, meta["num_draft_tokens"], tmp / SPECULATORS_DIR)
        (tmp / "eval").mkdir()
        for f in sorted(eval_dir.iterdir()):
            if f.is_file() and (f.suffix == ".png" or f.name in ("report.json", "report.md")):
                shutil.copy2(f, tmp / "eval" / f.name)
        (tmp / BUNDLE_JSON).write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(meta))
        write_checksums(tmp)
    m = meta["measured"]
    log.info("export: bundle written in %.1fs", time.perf_counter() - t0)
    print(f"export: bundle -> {out}")
    print(f"  {'method':<12} {'k':>3} {'tau':>6} {'tok/s':>8} {'vs plain':>9} {'draft cost':>11}")
    print(f"  {name:<12} {meta['num_draft_tokens']:>3} {m['tau']:>6.2f} {m['tokens_per_s']:>8.2f} "
          f"{m['speedup_vs_plain']:>8.2f}x {m['draft_cost_ratio'] or 0:>11.3f}")
    return out
