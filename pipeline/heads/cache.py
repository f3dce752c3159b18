"""Offline target features for the heads stage: the frozen target's hidden states, computed
once and cached to disk in fp16 shards, so every later epoch costs only the heads.

`runs/<run>/heads/features/<key>/` holds `shard-NNNNN.safetensors` (one tensor per example,
[T, n_layers * H] fp16, named by the example's index) and `meta.json`. The key hashes what
decides the values: target, layers, data, max_length, bf16; a head needing fewer layers
reads an existing cache that holds them (find_cache). Each shard is written
atomically and never redone, so a killed caching run resumes where it stopped. The disk it
will take is printed before it starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pipeline.decode.static_kv import with_hidden_states
from pipeline.files import atomic_write_json, own_dir, rename
from pipeline.train.data import Batch, Example, collate

log = logging.getLogger(__name__)
SHARD = "shard-{:05d}.safetensors"


def cache_dir(heads_root: Path, fingerprint: str, layers: list[int], data_key: str, max_length: int,
              bf16: bool) -> Path:
    key = json.dumps(dict(target=fingerprint, layers=layers, data=data_key, max_length=max_length, bf16=bf16),
                     sort_keys=True)
    return heads_root / "features" / hashlib.sha256(key.encode()).hexdigest()[:16]


def find_cache(heads_root: Path, fingerprint: str, layers: list[int], data_key: str, max_length: int,
               bf16: bool) -> tuple[Path, list[int]]:
    """The cache folder for `layers` and the layers it holds: a cache already on disk for the
    same target, data, max_length and bf16 whose layers include `layers` (EAGLE's layers
    include the last, all Medusa needs), else this key's own folder."""
    own = cache_dir(heads_root, fingerprint, layers, data_key, max_length, bf16)
    if (own / "meta.json").is_file():
        return own, layers
    for meta in sorted((heads_root / "features").glob("*/meta.json")):
        held = json.loads(meta.read_text()).get("layers", [])
        if set(layers) <= set(held) and cache_dir(heads_root, fingerprint, held, data_key, max_length,
                                                  bf16) == meta.parent:
            return meta.parent, held
    return own, layers


class FeatureCache:
    """Cached hidden states of `layers` (output_hidden_states indices) for a list of examples."""

    def __init__(self, folder: Path, layers: list[int], hidden_size: int, shard_size: int) -> None:
        self.folder, self.layers, self.hidden_size, self.shard_size = folder, layers, hidden_size, shard_size
        self._open: dict[int, object] = {}

    def shard_path(self, shard: int) -> Path:
        return self.folder / SHARD.format(shard)

    def build(self, target: torch.nn.Module, examples: list[Example], pad_id: int, batch_tokens: int,
              bf16: bool) -> None:
        """Compute and write every missing shard (the main process only): each shard's sequences
        longest first, up to `batch_tokens` tokens a target pass, so a pass's rows are of about
        one length and pad little (right padding, which causal attention needs no mask for:
        run_target); packed rows would pad nothing but need a mask, and measured slower."""
        from safetensors.torch import save_file

        own_dir(self.folder, "features", adopt=lambda folder: (folder / "meta.json").is_file())
        shards = range((len(examples) + self.shard_size - 1) // self.shard_size)
        todo = [s for s in shards if not self.shard_path(s).is_file()]
        tokens = sum(len(ex.input_ids) for ex in examples)
        gib = tokens * len(self.layers) * self.hidden_size * 2 / 2**30
        print(f"heads: caching target features of {len(examples)} sequences ({tokens:,} tokens, layers "
              f"{self.layers}) in fp16: {gib:.2f} GiB on disk in {self.folder}"
              + (f"; {len(shards) - len(todo)} of {len(shards)} shards already there" if len(todo) < len(shards) else ""))
        atomic_write_json(self.folder / "meta.json", dict(layers=self.layers, hidden_size=self.hidden_size,
                                                           shard_size=self.shard_size, sequences=len(examples),
                                                           tokens=tokens, bytes=int(gib * 2**30)))
        device = next(target.parameters()).device
        todo_tokens = sum(len(examples[i].input_ids) for s in todo for i in self.members(s, len(examples)))
        with tqdm(total=todo_tokens, desc="cache features", unit="tok", unit_scale=True, dynamic_ncols=True) as bar:
            for shard in todo:
                chosen = sorted(self.members(shard, len(examples)), key=lambda i: -len(examples[i].input_ids))
                tensors = {}
                for part in token_batches(chosen, [len(examples[i].input_ids) for i in chosen], batch_tokens):
                    batch = collate([examples[i] for i in part], pad_id, False).to(device)
                    hidden = run_target(target, batch, self.layers, bf16)
                    joined = torch.cat([hidden[i] for i in self.layers], dim=-1).to(torch.float16).cpu()
                    for (row, col), i in zip(batch.starts.tolist(), part):
                        tensors[str(i)] = joined[row, col : col + len(examples[i].input_ids)].contiguous()
                    bar.update(int(batch.attention_mask.sum()))
                tmp = self.shard_path(shard).with_suffix(".tmp")
                save_file(tensors, str(tmp))
                rename(tmp, self.shard_path(shard))  # a shard is there whole or not at all

    def members(self, shard: int, num_examples: int) -> range:
        return range(shard * self.shard_size, min((shard + 1) * self.shard_size, num_examples))

    def hidden(self, indices: list[int], batch: Batch) -> dict[int, torch.Tensor]:
        """The cached hidden states of examples `indices`, placed as `batch` holds them (padded or
        packed, batch.starts): layer -> [B, T, H]."""
        from safetensors import safe_open

        b, t = batch.input_ids.shape
        out = torch.zeros((b, t, len(self.layers) * self.hidden_size), dtype=torch.float32)
        for (row, col), i in zip(batch.starts.tolist(), indices):
            shard = i // self.shard_size
            if shard not in self._open:
                self._open[shard] = safe_open(str(self.shard_path(shard)), framework="pt")
            value = self._open[shard].get_tensor(str(i))
            out[row, col : col + value.shape[0]] = value
        out = out.to(batch.input_ids.device)
        h = self.hidden_size
        return {layer: out[..., j * h : (j + 1) * h] for j, layer in enumerate(self.layers)}


def token_batches(items: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """`items` (longest first) in consecutive batches of at most `budget` tokens (one item each
    where an item alone is longer)."""
    batches, current, tokens = [], [], 0
    for item, n in zip(items, lengths):
        if current and tokens + n > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(item)
        tokens += n
    return batches + [current] if current else batches


@torch.no_grad()
def run_target(target: torch.nn.Module, batch: Batch, layers: list[int], bf16: bool) -> dict[int, torch.Tensor]:
    """The frozen target's hidden states `layers` on a batch, padded or packed (bf16 autocast if
    asked). Padded rows need no mask: they are padded on the right, and under causal attention
    no real token sees a later one, so the plain causal kernel serves (it skips the blocks above
    the diagonal, where one given a mask computes them all); what padding holds is never read."""
    mask = batch.model_mask() if batch.segments is not None else None
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = target.get_decoder()(input_ids=batch.input_ids, attention_mask=mask,
                                   position_ids=batch.position_ids, use_cache=False, **with_hidden_states(layers))
    dtype = next(target.parameters()).dtype
    return {i: out.hidden_states[i].to(dtype) for i in layers}
