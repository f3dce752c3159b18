"""Our decoder against transformers' on the same target, prompts and drafts, in one process.

    python benchmarks/bench_eval.py [hydra overrides...]

Runs the eval stage on the embedded target and MT-bench with plain decoding, prompt lookup
(ngram) and a separate draft model, plus HF `generate`, HF prompt lookup and HF assisted
generation with the same draft and num_draft_tokens, then prints one table. The draft is
the target's first 4 layers with its norm and LM head (untrained): the point is the
decoders, not the draft.
"""

from __future__ import annotations

import json
import sys

from hydra import compose, initialize_config_dir

from pipeline.__main__ import CONF_DIR, quiet_library_progress_bars
from pipeline.config import to_config
from pipeline.eval import run
from pipeline.distill.draft import first_layers_draft
from pipeline.models import cache_root, load_target

DRAFT_LAYERS = 4
DEFAULTS = [
    "stage=eval", "data=mtbench", "data.limit=4", "eval.max_new_tokens=64", "eval.sweep=[1,2,4]",
    "eval.sweep_prompts=2", "eval.compare_hf=true", "run=bench",
]


def draft_folder():
    folder = cache_root() / "drafts" / f"smollm2_135m-first{DRAFT_LAYERS}"
    if not (folder / "config.json").is_file():
        target = load_target("smollm2_135m")
        first_layers_draft(target.model, DRAFT_LAYERS).save_pretrained(folder, safe_serialization=True)
        target.tokenizer.save_pretrained(folder)
    return folder


def main() -> None:
    quiet_library_progress_bars()
    overrides = [*DEFAULTS, f"eval.draft={draft_folder()}", *sys.argv[1:]]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = to_config(compose(config_name="config", overrides=overrides))
    out = run(cfg)
    report = json.loads((out / "report.json").read_text())
    plain = report["baselines"]["plain"]["tokens_per_s"]
    hf = report["baselines"]["hf_generate"]["tokens_per_s"]
    print(f"\n{report['num_prompts']} MT-bench conversations ({report['num_turns']} turns), "
          f"max_new_tokens={report['max_new_tokens']}, greedy, {report['dtype']}, {report['threads']} threads")
    print("| decoder | drafter | k | τ | tokens/s | vs our plain | vs HF generate |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print(f"| HF generate | – | – | – | {hf:.2f} | {hf / plain:.2f}x | 1.00x |")
    print(f"| ours | plain | – | 1.00 | {plain:.2f} | 1.00x | {plain / hf:.2f}x |")
    for name, m in report["methods"].items():
        if name == "plain":
            continue
        print(f"| ours | {name} | {m['num_draft_tokens']} | {m['tau']:.2f} | {m['tokens_per_s']:.2f} | "
              f"{m['speedup_vs_plain']:.2f}x | {m['speedup_vs_hf']:.2f}x |")
    for name, m in report["hf_methods"].items():
        ours = report["methods"][m["ours"]]["tokens_per_s"]
        print(f"| HF | {name} | {m['num_draft_tokens']} | – | {m['tokens_per_s']:.2f} | {m['speedup_vs_plain']:.2f}x | "
              f"{m['speedup_vs_hf']:.2f}x (ours {ours / m['tokens_per_s']:.2f}x faster) |")
    print(f"\nreport: {out / 'report.md'}")


if __name__ == "__main__":
    main()
