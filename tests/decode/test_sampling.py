"""Speculative sampling emits tokens distributed exactly as the target's own samples.

Each distribution test compares counts with the exact target distribution by a chi-square
test, and first shows that the same number of samples rejects a distribution 2% (in total
variation) away from the truth, so a pass means something.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.decode import ModelDrafter, NgramDrafter, StaticModel, speculative_decode, tree_decode
from pipeline.decode.prepare import restrict_vocabulary
from pipeline.decode.sampling import process_logits
from pipeline.heads import build_heads
from pipeline.kernels.acceptance import accept_sampling
from pipeline.kernels.linear import int8_linears
from pipeline.kinds import make_drafter

VOCAB = 6
HEAD_SETTINGS = {"medusa": dict(num_heads=2, num_layers=1), "eagle": dict(feature_layers=[0, 1], ttt_steps=1),
                 "early_exit": dict(exit_layer=1, adapter_rank=4)}
P_VALUE = 1e-3  # fixed seeds make every test deterministic; this is the bar each must clear


def sharp_llama(seed: int, scale: float) -> LlamaForCausalLM:
    """A tiny Llama whose next-token distributions are far from uniform (and far from another seed's)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def shifted_by_tv(p: torch.Tensor, tv: float) -> torch.Tensor:
    """A distribution at total-variation distance `tv` from p, moving mass between its two
    largest outcomes: the direction a chi-square test is least sensitive to."""
    first, second = p.topk(2).indices
    q = p.clone()
    q[first] -= tv
    q[second] += tv
    return q


def assert_matches(counts: torch.Tensor, probs: torch.Tensor, what: str, power_tv: float = 0.02) -> None:
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0, f"{what}: a zero-probability outcome was emitted"
    observed = counts[keep].double()
    truth = probs[keep].double() / probs[keep].double().sum()
    # Power check: the same sample size must reject an error of power_tv (2% by default).
    wrong = shifted_by_tv(truth, power_tv)
    assert chisquare(observed, wrong * n).pvalue < P_VALUE, f"{what}: too few samples to see a {power_tv:.0%} error"
    assert chisquare(observed, truth * n).pvalue > P_VALUE, what


def exact_distribution(model, prompt: list[int], length: int, temperature: float, top_p: float) -> torch.Tensor:
    """P(first `length` emitted tokens) under the target's processed distribution, by enumeration."""
    seqs = list(itertools.product(range(VOCAB), repeat=length))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.inference_mode():
        probs = process_logits(model(ids).logits, temperature, top_p)  # [N, P+L, V]
    joint = torch.ones(len(seqs))
    for i in range(length):
        joint *= probs[:, len(prompt) - 1 + i].gather(1, ids[:, len(prompt) + i, None]).squeeze(1)
    return joint.double()  # indexed like itertools.product


def test_accept_sampling_emits_p_for_any_q():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(VOCAB, generator=gen) * 2, dim=0)
    q = torch.softmax(torch.randn(VOCAB, generator=gen) * 2, dim=0)
    n = 60_000
    draft = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]  # [N, 1] sampled from q
    num_accepted, nxt = accept_sampling(draft, torch.ones(n, dtype=torch.long), q.expand(n, 1, VOCAB),
                                        p.expand(n, 2, VOCAB), torch.rand((n, 1), generator=gen),
                                        torch.rand(n, generator=gen))
    emitted_first = torch.where(num_accepted == 1, draft[:, 0], nxt)
    assert_matches(torch.bincount(emitted_first, minlength=VOCAB), p, "first token")
    # The acceptance rate is sum(min(p, q)) = 1 - TV(p, q).
    assert abs(num_accepted.double().mean() - torch.minimum(p, q).sum()) < 0.01


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    torch.testing.assert_close(process_logits(logits, 1.0, 0.7), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(process_logits(logits, 1.0, 0.5), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(process_logits(logits, 1.0, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    hot = process_logits(logits, 2.0)
    torch.testing.assert_close(hot, torch.softmax(logits / 2.0, dim=0))


def lookup_prompt(target) -> list[int]:
    """The target's own greedy continuation of [1, 4], then [1, 4] again: prompt lookup
    proposes that continuation, which the target accepts often but not always."""
    with torch.inference_mode():
        start = target.generate(torch.tensor([[1, 4]]), max_new_tokens=3, do_sample=False)[0].tolist()
    return start + [1, 4]


def random_heads(kind: str, target):
    """Heads of `kind` with random trained weights, proposing from 5 of the 6 tokens."""
    heads = build_heads(kind, target, torch.tensor([0, 1, 2, 4, 5]), HEAD_SETTINGS[kind])
    with torch.no_grad():
        for p in heads.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    return heads.eval()


@pytest.mark.parametrize("drafter_kind, k, temperature, top_p, threshold, fixed", [
    ("plain", 0, 1.0, 1.0, 0.0, False),
    ("draft_model", 2, 1.0, 1.0, 0.0, False),
    ("draft_model", 4, 0.7, 0.9, 0.0, True),
    ("draft_model", 3, 1.0, 1.0, 0.6, False),  # chains end at a sampled token of draft probability < 0.6
    ("draft_model", 2, 0.7, 0.9, 0.6, True),
    ("ngram", 3, 1.0, 1.0, 0.0, False),
    ("ngram", 3, 1.0, 1.0, 0.0, True),
    ("draft_vocab", 2, 1.0, 1.0, 0.0, False),  # a draft proposing from 4 of the 6 tokens
    ("draft_int8", 3, 1.0, 1.0, 0.0, False),  # a draft whose linear layers run in int8 (eval's CPU default)
    ("medusa", 2, 1.0, 1.0, 0.0, False),
    ("eagle", 3, 0.8, 0.95, 0.0, True),
    ("eagle", 3, 1.0, 1.0, 0.3, False),
    ("early_exit", 2, 1.0, 1.0, 0.0, True),
])
def test_speculative_sampling_matches_the_target_distribution(drafter_kind, k, temperature, top_p, threshold, fixed):
    """`fixed`: at the fixed shapes CUDA graphs need (every step verifies k drafts, chains draw k
    tokens), else as a CPU runs (only what some row proposed). Both use the fused acceptance with
    its inverse-CDF draw from the residual."""
    target = sharp_llama(0, scale=15.0)
    prompt = lookup_prompt(target)
    length, n = 3, 24_000
    gen = torch.Generator().manual_seed(1)
    drafter = None
    if drafter_kind == "ngram":
        drafter = NgramDrafter(temperature=temperature, vocab_size=VOCAB)
    elif drafter_kind in HEAD_SETTINGS:
        drafter = make_drafter(drafter_kind, random_heads(drafter_kind, target), target, temperature=temperature,
                               top_p=top_p, generator=gen, confidence_threshold=threshold, fixed_shapes=fixed)
    elif drafter_kind != "plain":
        draft = sharp_llama(7, scale=15.0)
        if drafter_kind == "draft_vocab":
            restrict_vocabulary(draft, torch.tensor([0, 2, 3, 5]))
        if drafter_kind == "draft_int8":
            assert int8_linears(draft) > 0
        drafter = ModelDrafter(draft, temperature, top_p, gen, confidence_threshold=threshold, fixed_shapes=fixed)
    # One batch of n identical prompts: rows are independent samples that accept different lengths.
    out = speculative_decode(StaticModel(target, fixed_shapes=fixed), drafter, [prompt] * n, num_draft_tokens=k,
                             max_new_tokens=length, eos_ids=set(), temperature=temperature, top_p=top_p,
                             generator=gen)
    check_samples(out, target, prompt, temperature, top_p, threshold, drafted=drafter is not None)


def check_samples(out, target, prompt, temperature, top_p, threshold, drafted=True) -> None:
    """out: n rows of `length` tokens sampled for `prompt` -> each position's marginal and the
    first two tokens' joint match the target's exact distribution."""
    n, length = len(out.tokens), len(out.tokens[0])
    if drafted:  # both kinds of step are common: runs of accepted drafts, and rejections with residual sampling
        accepted, proposed = out.accepted_by_position, out.proposed_by_position
        assert accepted[1] > n / 20 and proposed[0] - accepted[0] > n / 20, (proposed, accepted)
        if threshold:  # and chains that ended early: accepted first tokens whose second was never proposed
            assert accepted[0] - proposed[1] > n / 20, (proposed, accepted)
    seqs = torch.tensor(out.tokens)  # [N, length]
    index = (seqs * torch.tensor([VOCAB ** (length - 1 - i) for i in range(length)])).sum(1)
    joint = torch.bincount(index, minlength=VOCAB ** length)
    exact = exact_distribution(target, prompt, length, temperature, top_p)
    for i in range(length):  # each position's marginal
        marginal = exact.reshape([VOCAB] * length).sum(dim=tuple(j for j in range(length) if j != i))
        assert_matches(torch.bincount(seqs[:, i], minlength=VOCAB), marginal, f"token {i + 1}")
    # The joint of the first two tokens (36 outcomes).
    pairs = joint.reshape(VOCAB * VOCAB, VOCAB).sum(1)
    assert_matches(pairs, exact.reshape(VOCAB * VOCAB, VOCAB).sum(1), "tokens 1-2")


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_tree_acceptance_samples_the_target_distribution(temperature, top_p):
    """Walking a token tree (siblings tried in turn, each rejected token's mass removed)
    emits the target's distribution: the first token's, and the second's given the first."""
    from pipeline.decode.tree import sampling_walk_on_device
    from pipeline.decode.types import TreeProposal

    gen = torch.Generator().manual_seed(0)
    # Root children: tokens 0, 2 and 2 again (a duplicate is never accepted twice); node 1 (token 0)
    # has children 1 and 3.
    tree = TreeProposal(torch.tensor([0, 2, 2, 1, 3]), torch.tensor([-1, -1, -1, 0, 0]))
    logits = torch.randn((6, VOCAB), generator=gen) * 2.0
    logits[0, 0] = logits[0].max() + 0.5  # token 0 first about half the time: enough samples after it
    n = 40_000
    first, second_after_0 = torch.zeros(VOCAB), torch.zeros(VOCAB)
    tokens = [-1] + tree.tokens.tolist()
    for _ in range(n):
        path, accepted, following, _ = sampling_walk_on_device(tree.tokens, tree.parents, logits, 2, temperature,
                                                               top_p, gen)
        emitted = [tokens[i] for i in path[1: 1 + int(accepted)].tolist()] + [int(following)]
        first[emitted[0]] += 1
        if emitted[0] == 0:
            second_after_0[emitted[1]] += 1
    assert_matches(first, process_logits(logits[0], temperature, top_p), "first token")
    assert_matches(second_after_0, process_logits(logits[1], temperature, top_p), "second token after token 0")


@pytest.mark.parametrize("kind, temperature, top_p", [("medusa", 1.0, 1.0), ("eagle", 0.8, 0.95)])
def test_tree_decoding_samples_the_target_distribution(kind, temperature, top_p):
    """End to end through tree_decode: heads with random weights propose trees (Medusa's static
    tree, EAGLE-2's dynamic one), one target pass verifies each, the walk runs on the device,
    and the emitted tokens are distributed as the target's own samples. Each prompt is decoded
    alone (batch size 1), so fewer samples than the chain test: the power check is against a 4%
    error."""
    target = sharp_llama(0, scale=15.0)
    prompt = lookup_prompt(target)
    length, n = 2, 6_000
    gen = torch.Generator().manual_seed(1)
    drafter = make_drafter(kind, random_heads(kind, target), target, temperature=temperature, top_p=top_p,
                           generator=gen, tree_depth=2, tree_topk=2)
    out = tree_decode(StaticModel(target), drafter, [prompt] * n, budget=4, max_new_tokens=length, eos_ids=set(),
                      temperature=temperature, top_p=top_p, generator=gen)
    accepted, proposed = out.accepted_by_position, out.proposed_by_position
    assert accepted[0] > n / 20 and proposed[0] - accepted[0] > n / 20, (proposed, accepted)
    seqs = torch.tensor(out.tokens)  # [N, length]
    exact = exact_distribution(target, prompt, length, temperature, top_p).reshape(VOCAB, VOCAB)
    assert_matches(torch.bincount(seqs[:, 0], minlength=VOCAB), exact.sum(1), "token 1", power_tv=0.04)
    assert_matches(torch.bincount(seqs[:, 1], minlength=VOCAB), exact.sum(0), "token 2", power_tv=0.04)
    pairs = torch.bincount(seqs[:, 0] * VOCAB + seqs[:, 1], minlength=VOCAB * VOCAB)
    assert_matches(pairs, exact.flatten(), "tokens 1-2", power_tv=0.04)
