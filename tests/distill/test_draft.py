"""Draft construction from the target: shapes, copied weights, clear refusals."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.distill.draft import first_layers_draft, new_draft
from pipeline.errors import PipelineError


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()


def test_new_draft_copies_the_named_layers_embeddings_and_norm(target):
    draft = new_draft(target, num_layers=2, init_layers=[0, -1])
    assert draft.config.num_hidden_layers == 2 and draft.config.vocab_size == 64
    t, d = target.state_dict(), draft.state_dict()
    torch.testing.assert_close(d["model.embed_tokens.weight"], t["model.embed_tokens.weight"])
    torch.testing.assert_close(d["model.norm.weight"], t["model.norm.weight"])
    torch.testing.assert_close(d["model.layers.1.mlp.down_proj.weight"], t["model.layers.3.mlp.down_proj.weight"])
    torch.testing.assert_close(d["model.layers.0.self_attn.q_proj.weight"], t["model.layers.0.self_attn.q_proj.weight"])
    assert draft.lm_head.weight is draft.model.embed_tokens.weight


def test_untied_draft_copies_the_tied_targets_head(target):
    draft = new_draft(target, num_layers=1, tie_embeddings=False)
    assert draft.lm_head.weight is not draft.model.embed_tokens.weight
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight)


def test_random_layers_are_the_same_in_every_build_and_leave_the_global_rng_alone(target):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = new_draft(target, num_layers=1)
    assert torch.rand(1) == before
    b = new_draft(target, num_layers=1)
    torch.testing.assert_close(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)


def test_first_layers_draft_reproduces_the_targets_first_layers(target):
    draft = first_layers_draft(target, 4 - 1)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        hidden_t = target.model(ids, output_hidden_states=True).hidden_states[2]
        hidden_d = draft.model(ids, output_hidden_states=True).hidden_states[2]
    torch.testing.assert_close(hidden_d, hidden_t)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=1, hidden_size=16, init_layers=[]), "hidden size"),
    (dict(num_layers=1, init_layers=[7]), "init_layers"),
    (dict(num_layers=1, init_layers=[0, 1]), "init_layers"),
    (dict(num_layers=1, init_layers=[-5]), "init_layers"),
])
def test_impossible_drafts_are_refused(target, kwargs, message):
    with pytest.raises(PipelineError, match=message):
        new_draft(target, **kwargs)


def test_a_narrow_draft_starts_from_scratch(target):
    draft = new_draft(target, num_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      num_key_value_heads=1, init_embeddings=False)
    assert draft.config.hidden_size == 16 and draft.lm_head.weight.shape == (64, 16)
    assert draft(torch.tensor([[1, 2]])).logits.shape == (1, 2, 64)


def test_frequent_tokens_ranks_by_count_then_id_and_tops_up():
    from pipeline.train.data import frequent_tokens

    assert frequent_tokens([5, 5, 5, 2, 2, 9, 7], 3, 10).tolist() == [2, 5, 7]  # 7 and 9 tie: lower id first
    assert frequent_tokens([4, 4], 3, 10).tolist() == [0, 1, 4]


def test_draft_vocabulary_is_saved_read_and_checked(target, tmp_path):
    from pipeline.decode.prepare import restrict_vocabulary
    from pipeline.distill.draft import read_draft_vocab, save_draft_vocab

    assert read_draft_vocab(tmp_path, 64) is None
    ids = torch.tensor([1, 4, 9])
    save_draft_vocab(ids, tmp_path)
    assert read_draft_vocab(tmp_path, 64).tolist() == [1, 4, 9]
    with pytest.raises(PipelineError, match="below 5"):
        read_draft_vocab(tmp_path, 5)
    draft = new_draft(target, num_layers=1, init_layers=[0])
    x = torch.tensor([[3, 1, 4]])
    with torch.inference_mode():
        full = draft(x).logits
        restrict_vocabulary(draft, ids)
        small = draft(x).logits
    torch.testing.assert_close(small, full[..., ids])
    assert draft.draft_to_target.tolist() == [1, 4, 9]
