"""Greedy speculative decoding with the real embedded target reproduces its greedy output."""

import pytest
import torch

from pipeline.data.chat import eos_token_ids, first_prompt_ids
from pipeline.data.sources import load_conversations
from pipeline.decode import ModelDrafter, NgramDrafter, StaticModel, plain_decode, speculative_decode
from pipeline.distill.draft import first_layers_draft
from pipeline.models import load_target

pytestmark = pytest.mark.slow
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def setup():
    target = load_target("smollm2_135m", dtype="float32", device="cpu")
    tok = target.tokenizer
    convs = load_conversations("mtbench", limit=24).conversations[::8]  # 3 categories
    prompts = [first_prompt_ids(tok, c) for c in convs]
    eos = set(eos_token_ids(target.generation_config, tok))
    static = StaticModel(target.model)  # switches the model to our static attention, in place
    plain = [plain_decode(static, [p], max_new_tokens=MAX_NEW_TOKENS, eos_ids=eos).tokens[0] for p in prompts]
    return target, static, prompts, eos, plain


def divergences(target, prompts, got, want):
    """(index, is_tie) of each row whose output differs from plain greedy decoding.

    A divergence is tolerated only at an exact tie: the target's two best logits at the
    first differing position are equal within float noise.
    """
    found = []
    for prompt, g, w in zip(prompts, got, want):
        if g == w:
            continue
        i = next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + w[:i]])).logits[0, -1]
        top2 = logits.topk(2).values
        found.append((i, bool(top2[0] - top2[1] < 1e-4)))
    return found


def test_plain_decoding_equals_hf_generate(setup):
    """HF generate on the same model object: called without a static step, the static
    attention runs transformers' sdpa attention."""
    target, _, prompts, eos, plain = setup
    for prompt, ours in zip(prompts, plain):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                       do_sample=False, eos_token_id=list(eos),
                                       pad_token_id=target.tokenizer.pad_token_id)[0, len(prompt):].tolist()
        cut = next((i + 1 for i, t in enumerate(hf) if t in eos), len(hf))
        assert ours == hf[:cut]


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("k", [1, 4])
def test_speculative_greedy_equals_plain_greedy(setup, drafter, k):
    target, static, prompts, eos, plain = setup
    make = (lambda: NgramDrafter()) if drafter == "ngram" else (lambda: ModelDrafter(first_layers_draft(target.model, 4)))
    got = [speculative_decode(static, make(), [p], num_draft_tokens=k, max_new_tokens=MAX_NEW_TOKENS,
                              eos_ids=eos).tokens[0] for p in prompts]
    found = divergences(target, prompts, got, plain)
    if found:
        print(f"{drafter} k={k}: divergences at exact logit ties (position, tie): {found}")
    assert all(tie for _, tie in found), found


def test_batched_speculative_greedy_equals_plain_greedy(setup):
    target, static, prompts, eos, plain = setup
    got = speculative_decode(static, ModelDrafter(first_layers_draft(target.model, 4)), prompts,
                             num_draft_tokens=4, max_new_tokens=MAX_NEW_TOKENS, eos_ids=eos).tokens
    found = divergences(target, prompts, got, plain)
    assert all(tie for _, tie in found), found


def test_decode_layout_keeps_greedy_outputs(setup):
    """The eval stage's decode layout (kernels/linear.py: small-batch products, oneDNN from 3 rows)
    keeps greedy outputs, in plain and batched speculative decoding over the static attention
    (which reads the grouped key/value heads without copies)."""
    import copy

    from pipeline.kernels.linear import decode_layout

    target, _, prompts, eos, plain = setup
    model = copy.deepcopy(target.model)
    draft = first_layers_draft(target.model, 4)
    assert decode_layout(model) > 0 and decode_layout(draft) > 0
    static = StaticModel(model)
    relaid = [plain_decode(static, [p], max_new_tokens=MAX_NEW_TOKENS, eos_ids=eos).tokens[0] for p in prompts]
    assert all(tie for _, tie in divergences(target, prompts, relaid, plain))
    got = speculative_decode(static, ModelDrafter(draft), prompts, num_draft_tokens=4, max_new_tokens=MAX_NEW_TOKENS,
                             eos_ids=eos).tokens
    assert all(tie for _, tie in divergences(target, prompts, got, relaid))
