"""Loading the target: a target split over devices by target.max_memory computes what it does whole."""

import torch

from pipeline.models import load_target


def test_a_target_split_by_max_memory_gives_the_unsplit_logits(tiny_target_dir, cache_dir, capsys):
    whole = load_target(str(tiny_target_dir), cache_dir=str(cache_dir), device="cpu")
    capsys.readouterr()
    # No GPU here: what does not fit the CPU's share goes to disk (offloaded, loaded per forward).
    split = load_target(str(tiny_target_dir), cache_dir=str(cache_dir), device_map="auto",
                        max_memory={"cpu": "100KB"})
    planned = capsys.readouterr().out
    assert "target: planned memory cpu" in planned and "disk" in planned
    assert set(split.model.hf_device_map.values()) == {"cpu", "disk"}
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.inference_mode():
        assert torch.allclose(split.model(ids).logits, whole.model(ids).logits, atol=1e-5)
    assert split.fingerprint() == whole.fingerprint()


def test_without_weights_only_the_tokenizer_and_generation_config_load(tiny_target_dir, cache_dir):
    target = load_target(str(tiny_target_dir), cache_dir=str(cache_dir), weights=False)
    assert target.model is None and target.tokenizer.eos_token_id is not None
    assert target.generation_config.eos_token_id == target.tokenizer.eos_token_id
