"""What one training step costs, in one process (alternating repetitions, medians); on CUDA where
there is a GPU. Three tables:

    python benchmarks/bench_train.py [--batch-size 8] [--length 512] [--reps 3] [--only distill|heads|cache]

- distill: one step of the CPU distill recipe's shape (conf/draft/new.yaml, experiment=recipe_cpu):
  a 2-layer draft of the embedded target with frozen tied embeddings, logits over an 8192-token
  draft vocabulary at the answer positions, forward KL against a random teacher, backward and an
  AdamW step; padded and packed (distill.pack=true), fp32 and bf16.
- heads: one step of an EAGLE head (heads=eagle: three fused layers, training-time test) and of
  Medusa heads (heads=medusa) on cached target features (heads.features=offline, read from a
  real cache on disk), with its split: data (collate + the cache read), the target's
  distribution (its draft-vocabulary logits from the cached last hidden state), the heads'
  forward, the loss, backward, the optimizer. `before` is the step as it was: padded rows, fp32,
  the target's full-vocabulary distribution and the acceptance statistics at every step.
- cache: the feature-cache pass (the frozen target over the data, its hidden states kept): as
  before (--batch-size sequences a pass in data order, padding masked), packed rows, and
  passes of sequences of about one length, right-padded without a mask (what
  heads.features=offline runs), fp32 and bf16.

The batch's conversations are 1/8 to all of --length tokens long, as chat data is; their second
half is learned. tokens/s counts real tokens. precision=auto picks bf16 only where this device
computes it natively; each table says what auto would pick here and what the other choice costs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.distributed import native_bf16, resolve_precision
from pipeline.models import load_target
from pipeline.train.data import Example, collate


def chat_batch(batch_size: int, length: int, vocab: int, seed: int = 0) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 8, length + 1, (batch_size,), generator=gen).tolist()
    return [Example(str(i), torch.randint(0, vocab, (n,), generator=gen).tolist(), list(range(n // 2, n - 1)))
            for i, n in enumerate(lengths)]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def medians(times: dict) -> dict:
    return {s: sorted(t)[len(t) // 2] for s, t in times.items()}


def where(device) -> str:
    return (f"GPU {torch.cuda.get_device_name()}" if device.type == "cuda" else
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")


def alternate(settings: list, reps: int, step) -> dict:
    """step(setting) -> (seconds, extra) for every setting in turn, reps + 1 times (the first a
    warm-up): drifts in the machine's speed hit all settings alike."""
    times = defaultdict(list)
    for rep in range(reps + 1):
        for setting in settings:
            seconds = step(setting)
            if rep:
                times[setting].append(seconds)
    return medians(times)


def bench_distill(target, device, args) -> None:
    from pipeline.distill.draft import new_draft
    from pipeline.distill.stage import selected_logits

    draft = new_draft(target.model, num_layers=2, init_layers=[0, -1]).train()
    for module in (draft.get_input_embeddings(), draft.get_output_embeddings()):
        module.weight.requires_grad_(False)
    vocab = torch.arange(8192, device=device)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5)
    examples = chat_batch(args.batch_size, args.length, len(vocab))
    tokens = sum(len(ex.input_ids) for ex in examples)

    def step(setting) -> float:
        layout, precision = setting
        batch = collate(examples, 0, False, layout == "packed").to(device)
        teacher = torch.randn((len(batch.rows), len(vocab)), generator=torch.Generator().manual_seed(1))
        teacher = teacher.log_softmax(-1).to(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = selected_logits(draft, batch.input_ids, batch.model_mask(), batch.rows, batch.cols, vocab,
                                     batch.position_ids)
        loss = torch.nn.functional.kl_div(logits.float().log_softmax(-1), teacher, log_target=True,
                                          reduction="batchmean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    settings = [(layout, precision) for layout in ("padded", "packed") for precision in ("fp32", "bf16")]
    median = alternate(settings, args.reps, step)
    rows = {layout: collate(examples, 0, False, layout == "packed").input_ids.shape for layout in ("padded", "packed")}
    print(f"\ndistill: {where(device)}, native bf16: {native_bf16(device.type)}, distill.precision=auto -> "
          f"{resolve_precision('auto', device.type)}; {args.batch_size} conversations, {tokens} tokens "
          f"(padded {rows['padded'][0]} x {rows['padded'][1]}, packed {rows['packed'][0]} x {rows['packed'][1]})")
    print_table(median, tokens, ("padded", "fp32"), "s/step (median)")


class Split:
    """Seconds per named part of a step, the parts timed in order (each synced)."""

    def __init__(self, device) -> None:
        self.device, self.parts, self.t = device, {}, 0.0

    def start(self) -> None:
        sync(self.device)
        self.t = time.perf_counter()

    def mark(self, name: str) -> None:
        sync(self.device)
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self.t
        self.t = now

    @contextmanager
    def aside(self, name: str):
        """Time a part inside another (the loss inside the heads' forward) and leave it out of the other."""
        sync(self.device)
        t0 = time.perf_counter()
        yield
        sync(self.device)
        spent = time.perf_counter() - t0
        self.parts[name] = self.parts.get(name, 0.0) + spent
        self.t += spent


PARTS = ("data", "target distribution", "heads forward", "loss", "backward", "optimizer")


def bench_heads(target, device, args) -> None:
    from pipeline.heads import train as heads_train
    from pipeline.heads.cache import FeatureCache
    from pipeline.heads.models import build_heads, feature_indices
    from pipeline.heads.train import HeadsForTraining, target_layers, view_from_hidden

    model = target.model
    vocab = torch.arange(8192, device=device)  # heads.draft_vocab_size's default
    examples = chat_batch(args.batch_size, args.length, len(vocab), seed=2)
    tokens = sum(len(ex.input_ids) for ex in examples)
    indices = list(range(len(examples)))
    kinds = {"eagle": dict(feature_layers=list(feature_indices(model.config, [])), ttt_steps=3),
             "medusa": dict(num_heads=4, num_layers=1)}
    real_loss = heads_train.distill_loss
    with tempfile.TemporaryDirectory() as tmp:
        layers = sorted({layer for s in kinds.values() for layer in s.get("feature_layers", [])} |
                        set(target_layers(model, ())))
        cache = FeatureCache(Path(tmp) / "features", layers, model.config.hidden_size, len(examples))
        cache.build(model, examples, 0, args.batch_size * args.length, native_bf16(device.type))
        models = {}
        for kind, settings in kinds.items():
            heads = build_heads(kind, model, vocab, settings).train()
            wrapped = HeadsForTraining(heads, model, "forward_kl", 0.8, settings.get("ttt_steps", 1))
            models[kind] = (wrapped, torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-5))
        splits = {}

        def step(setting) -> float:
            kind, how = setting
            wrapped, optimizer = models[kind]
            before, bf16 = how == "before", how == "packed bf16"
            split = Split(device)
            heads_train.distill_loss = lambda *a, **k: timed_loss(split, *a, **k)
            split.start()
            batch = collate(examples, 0, False, pack=not before).to(device)
            hidden = cache.hidden(indices, batch)
            split.mark("data")
            view = view_from_hidden(model, hidden, batch, vocab, bf16, stats=before)
            split.mark("target distribution")
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = wrapped(view, batch).loss
            split.mark("heads forward")
            loss.backward()
            split.mark("backward")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            split.mark("optimizer")
            splits.setdefault(setting, []).append(split.parts)
            return sum(split.parts.values())

        def timed_loss(split, *a, **k):
            with split.aside("loss"):
                return real_loss(*a, **k)

        settings = [(kind, how) for kind in kinds for how in ("before", "packed fp32", "packed bf16")]
        try:
            median = alternate(settings, args.reps, step)
        finally:
            heads_train.distill_loss = real_loss
    rows = {layout: collate(examples, 0, False, layout == "packed").input_ids.shape for layout in ("padded", "packed")}
    print(f"\nheads on cached features: {where(device)}, native bf16: {native_bf16(device.type)}, heads.precision="
          f"auto -> {resolve_precision('auto', device.type)}; {args.batch_size} conversations, {tokens} tokens "
          f"(padded {rows['padded'][0]} x {rows['padded'][1]}, packed {rows['packed'][0]} x {rows['packed'][1]}), "
          f"draft vocabulary {len(vocab)}, EAGLE ttt_steps {kinds['eagle']['ttt_steps']}, Medusa "
          f"{kinds['medusa']['num_heads']} heads; `before`: padded, fp32, full-vocabulary distribution and statistics")
    print("| heads | step | s/step (median) | tokens/s | vs before | " + " | ".join(PARTS) + " |")
    print("|---|---|---:|---:|---:|" + "---:|" * len(PARTS))
    for (kind, how), seconds in median.items():
        timed = splits[(kind, how)][1:]  # the warm-up left out, as in the medians
        parts = {name: sorted(p.get(name, 0.0) for p in timed)[len(timed) // 2] for name in PARTS}
        print(f"| {kind} | {how} | {seconds:.3f} | {tokens / seconds:,.0f} | {median[(kind, 'before')] / seconds:.2f}x | "
              + " | ".join(f"{parts[name]:.3f}" for name in PARTS) + " |")


def bench_cache(target, device, args) -> None:
    from pipeline.decode.static_kv import with_hidden_states
    from pipeline.heads.cache import run_target, token_batches
    from pipeline.heads.models import feature_indices

    model = target.model
    layers = sorted(set(feature_indices(model.config, [])) | {model.config.num_hidden_layers})
    examples = [ex for seed in range(3) for ex in chat_batch(args.batch_size, args.length, 49152, seed=10 + seed)]
    tokens = sum(len(ex.input_ids) for ex in examples)
    order = sorted(examples, key=lambda ex: -len(ex.input_ids))
    by_length = [[order[i] for i in part] for part in token_batches(
        list(range(len(order))), [len(ex.input_ids) for ex in order], args.batch_size * args.length)]

    def step(setting) -> float:
        layout, precision = setting
        bf16 = precision == "bf16"
        sync(device)
        t0 = time.perf_counter()
        if layout == "before":  # --batch-size sequences a pass in data order, padding masked
            for i in range(0, len(examples), args.batch_size):
                batch = collate(examples[i : i + args.batch_size], 0, False).to(device)
                with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                        use_cache=False, **with_hidden_states(layers))
        else:
            for part in by_length:
                run_target(model, collate(part, 0, False, pack=layout == "packed").to(device), layers, bf16)
        sync(device)
        return time.perf_counter() - t0

    settings = [(layout, precision) for layout in ("before", "packed", "by length") for precision in ("fp32", "bf16")]
    median = alternate(settings, args.reps, step)
    print(f"\nfeature cache pass: {where(device)}, native bf16: {native_bf16(device.type)}, heads.target_bf16=null -> "
          f"{native_bf16(device.type)}; {len(examples)} conversations, {tokens} tokens, layers {layers}; `before`: "
          f"{args.batch_size} sequences a pass in data order, padding masked; `packed`: longest first, rows shared "
          f"up to {args.batch_size * args.length} tokens a pass (a mask keeps them apart); `by length`: longest "
          f"first, right-padded, no mask (what heads.features=offline runs)")
    print_table(median, tokens, ("before", "fp32"), "s (median)")


def print_table(median: dict, tokens: int, base_key: tuple[str, str], seconds_label: str) -> None:
    """A markdown table of (layout, precision) -> median seconds, as tokens/s and against `base_key`."""
    base = median[base_key]
    print(f"| layout | precision | {seconds_label} | tokens/s | vs {' '.join(base_key)} |")
    print("|---|---|---:|---:|---:|")
    for (layout, precision), seconds in median.items():
        print(f"| {layout} | {precision} | {seconds:.3f} | {tokens / seconds:,.0f} | {base / seconds:.2f}x |")


BENCHES = {"distill": bench_distill, "heads": bench_heads, "cache": bench_cache}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3, help="timed steps per setting, after one warm-up each")
    parser.add_argument("--only", choices=list(BENCHES), action="append", help="run only these tables")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target("smollm2_135m", dtype="float32", device=str(device))
    for name in args.only or BENCHES:
        BENCHES[name](target, device, args)


if __name__ == "__main__":
    main()
