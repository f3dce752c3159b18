"""Heads drafting through our decoder: greedy output equals plain greedy decoding, and
sampling emits the target's own distribution, for medusa, eagle and early_exit."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.decode import StaticModel, plain_decode, speculative_decode, tree_decode
from pipeline.heads.models import build_heads, load_heads, own_state, save_heads
from pipeline.kinds import make_drafter

SETTINGS = {
    "medusa": dict(num_heads=3, num_layers=1),
    "eagle": dict(feature_layers=[1, 2, 4], ttt_steps=1),
    "early_exit": dict(exit_layer=2, adapter_rank=8),
}


def tiny_target(vocab=40, layers=4, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def random_heads(kind, target, draft_vocab, seed=1, scale=0.3):
    """Heads whose trained weights are random (not their zero/identity start)."""
    heads = build_heads(kind, target, draft_vocab, SETTINGS[kind])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * scale)
    return heads.eval()


@pytest.mark.parametrize("kind", ["medusa", "eagle", "early_exit"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("vocab_rows", [40, 25])
@pytest.mark.parametrize("threshold", [0.0, 0.08])
def test_greedy_heads_match_plain_decoding(kind, k, vocab_rows, threshold):
    target = tiny_target()
    draft_vocab = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:vocab_rows]
    heads = random_heads(kind, target, draft_vocab)
    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 4, 4, 4, 8, 1]]  # different lengths in one batch
    common = dict(max_new_tokens=24, eos_ids={39})
    plain = plain_decode(StaticModel(target), prompts, **common)
    drafter = make_drafter(heads.kind, heads, target, confidence_threshold=threshold)
    out = speculative_decode(StaticModel(target), drafter, prompts, num_draft_tokens=k, **common)
    assert out.tokens == plain.tokens
    assert sum(out.proposed_by_position) > 0
    assert all(a <= p for a, p in zip(out.accepted_by_position, out.proposed_by_position))


def copying_eagle(target):
    """An EAGLE head that passes the target's last hidden state through (fc the identity, its
    layer adding nothing): it proposes the target's next token again, so it is accepted
    wherever the target repeats a token."""
    heads = build_heads("eagle", target, torch.arange(40), dict(feature_layers=[-1], ttt_steps=1))
    with torch.no_grad():
        heads.fc.weight.copy_(torch.eye(32))
        for p in heads.layer.parameters():
            p.zero_()
        heads.norm.weight.copy_(target.model.norm.weight)
    return heads.eval()


@pytest.mark.parametrize("kind", ["medusa", "eagle", "early_exit"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("threshold", [0.0, 0.08])
def test_heads_at_fixed_shapes_match_plain_decoding_and_a_cpus_steps(kind, k, threshold):
    """At the fixed shapes CUDA graphs need (every step verifies k drafts, chains draw k tokens)
    each head kind's chains give plain decoding's tokens and exactly the acceptance counts of
    the steps a CPU takes (only what some row proposed): the same proposals. The target (seed 1)
    runs into repeats, where the copying EAGLE head accepts whole chains."""
    target = tiny_target(seed=1)
    draft_vocab = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:25]
    heads = copying_eagle(target) if kind == "eagle" else random_heads(kind, target, draft_vocab)
    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 4, 4, 4, 8, 1]]
    common = dict(max_new_tokens=24, eos_ids={39})
    plain = plain_decode(StaticModel(target), prompts, **common)
    out = {fixed: speculative_decode(StaticModel(target, fixed_shapes=fixed),
                                     make_drafter(kind, heads, target, confidence_threshold=threshold,
                                                  fixed_shapes=fixed), prompts, num_draft_tokens=k, **common)
           for fixed in (False, True)}
    assert out[True].tokens == out[False].tokens == plain.tokens
    assert out[True].accepted_by_position == out[False].accepted_by_position
    assert out[True].proposed_by_position == out[False].proposed_by_position
    if kind == "eagle" and k > 1 and not threshold:
        assert out[True].accepted_by_position[k - 1] > 0  # whole chains accepted


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("budget", [1, 6, 20])
@pytest.mark.parametrize("copying", [False, True])
def test_greedy_trees_match_plain_decoding(kind, budget, copying):
    """Greedy trees (Medusa's static trees, EAGLE-2's dynamic ones built on the device; the walk
    and the accepted path's cache compaction on the device) give plain decoding's tokens.
    Copying heads (untrained Medusa heads, copying_eagle) on a target that repeats (seed 3)
    accept paths several nodes deep."""
    target = tiny_target(seed=3 if copying else 0)
    if kind == "eagle":
        heads = copying_eagle(target) if copying else random_heads(kind, target, torch.arange(40))
    else:
        heads = random_heads(kind, target, torch.arange(40), scale=0.0 if copying else 0.3)
    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 4, 4, 4, 8, 1]]
    common = dict(max_new_tokens=24, eos_ids={39})
    plain = plain_decode(StaticModel(target), prompts, **common)
    out = tree_decode(StaticModel(target), make_drafter(kind, heads, target), prompts, budget=budget, **common)
    assert out.tokens == plain.tokens
    assert out.proposed_by_position[0] > 0
    assert all(a <= p for a, p in zip(out.accepted_by_position, out.proposed_by_position))
    # Each pass emits its accepted nodes and one token of the target's (the last may be cut by max_new_tokens).
    assert sum(map(len, out.tokens)) <= sum(out.target_passes) + sum(out.accepted_by_position)
    if copying and budget > 1:
        assert out.accepted_by_position[1] > 0  # paths at least 2 deep
    if copying and budget > 1 and kind == "medusa":
        assert len(out.accepted_by_position) >= 3 and out.accepted_by_position[2] > 0  # and 3 deep


def test_device_tree_layout_follows_the_parents():
    from pipeline.decode.tree import tree_layout

    parents = torch.tensor([-1, -1, 0, 0, 2, 1, 4, -1, 6])
    anc, depth = tree_layout(parents, max_depth=5)
    expected = torch.eye(10, dtype=torch.bool)  # over (root, nodes): each node sees its parent's ancestors
    for i, parent in enumerate(parents.tolist()):
        expected[i + 1] |= expected[parent + 1]
    assert torch.equal(anc, expected)
    assert depth.tolist() == [0, 1, 1, 2, 2, 3, 2, 4, 1, 5]


def test_eagle_drafts_well_when_it_copies_the_target():
    """A head whose layer is the identity and whose feature is the target's last hidden state
    reproduces the target's own greedy next token at draft position 1: everything is accepted there."""
    target = tiny_target()
    heads = build_heads("eagle", target, torch.arange(40), dict(feature_layers=[-1], ttt_steps=1))
    # The head's output is its input: fc passes the feature through, the layer adds zero to
    # its residual stream (the feature).
    with torch.no_grad():
        size = 32
        heads.fc.weight.copy_(torch.eye(size))
        for p in heads.layer.parameters():
            p.zero_()
        heads.norm.weight.copy_(target.model.norm.weight)
    prompts = [[1, 5, 9, 2]]
    out = speculative_decode(StaticModel(target), make_drafter(heads.kind, heads, target), prompts, num_draft_tokens=1,
                             max_new_tokens=12, eos_ids=set())
    # The feature of position t is the target's pre-norm hidden state of t, whose norm + LM head
    # give token t+1 -- which is already known: the head proposes token t+1 for position t+2.
    # So it is accepted only where the target repeats a token; the check here is exactness.
    assert out.tokens == plain_decode(StaticModel(target), prompts, max_new_tokens=12, eos_ids=set()).tokens


@pytest.mark.parametrize("kind", ["medusa", "eagle", "early_exit"])
def test_heads_save_and_load_round_trip(kind, tmp_path):
    target = tiny_target()
    heads = random_heads(kind, target, torch.tensor([3, 1, 7, 20, 39]))
    save_heads(heads, tmp_path)
    loaded = load_heads(tmp_path, target)
    assert type(loaded) is type(heads) and loaded.settings == heads.settings
    assert torch.equal(loaded.draft_to_target, heads.draft_to_target)
    for name, value in own_state(heads).items():
        assert torch.equal(own_state(loaded)[name], value), name
    # Only the heads' own weights are stored, never the target's.
    assert all("embed_tokens" not in n for n in own_state(heads))


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_int8_heads_keep_greedy_outputs_and_leave_the_target_alone(kind):
    """Heads' own linear layers in int8 (eval's CPU default for Medusa; EAGLE only if asked):
    the target (whose embeddings and norms the heads borrow) is untouched, and chains and
    trees still emit exactly the target's plain greedy tokens."""
    from pipeline.kernels.linear import int8_linears, is_int8

    target = tiny_target()
    before = {n: p.clone() for n, p in target.state_dict().items()}
    heads = random_heads(kind, target, torch.randperm(40, generator=torch.Generator().manual_seed(3))[:30])
    fp32 = copy.deepcopy(heads)
    own = sum(type(m) is torch.nn.Linear for m in heads.modules())
    assert int8_linears(heads) == own and is_int8(heads) and not is_int8(target)
    assert all(torch.equal(p, before[n]) for n, p in target.state_dict().items())
    prompts = [[1, 5, 9, 2], [7, 3]]
    common = dict(max_new_tokens=24, eos_ids={39})
    plain = plain_decode(StaticModel(target), prompts, **common).tokens
    chains = {name: speculative_decode(StaticModel(target), make_drafter(h.kind, h, target), prompts,
                                       num_draft_tokens=3, **common)
              for name, h in (("int8", heads), ("fp32", fp32))}
    assert chains["int8"].tokens == plain == chains["fp32"].tokens
    assert chains["int8"].proposed_by_position[0] > 0
    tree = tree_decode(StaticModel(target), make_drafter(heads.kind, heads, target), prompts, budget=6, **common)
    assert tree.tokens == plain


def test_a_tree_step_keeps_exactly_the_accepted_paths_kv_entries():
    """After verifying a tree, the target's static cache holds the committed tokens' keys and
    values as if they had been decoded one by one: the accepted path's, in order."""
    from pipeline.decode.tree import greedy_walk_on_device, tree_layout
    from pipeline.decode.types import TreeProposal

    target = tiny_target()
    static = StaticModel(target)
    static.ready(1, 16)
    prompt = torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        logits = static.prefill(prompt, torch.tensor([4]))  # the prompt cached at slots 0..3
        last = int(logits[0].argmax())
        # The target's own next two tokens, as a path buried among wrong siblings and a deep decoy.
        follow = target.generate(torch.tensor([[1, 5, 9, 2, last]]), max_new_tokens=2, do_sample=False)[0, -2:]
        a, b = follow.tolist()
        wrong = lambda t: (t + 7) % 40
        tree = TreeProposal(torch.tensor([wrong(a), a, wrong(b), b, wrong(b), 11]),
                            torch.tensor([-1, -1, 1, 1, 0, 4]))
        anc, depth = tree_layout(tree.parents, 6)
        verify, inputs = static.replay(7, tree=True)
        inputs.start.fill_(4)
        inputs.positions.copy_(4 + depth[None])
        inputs.tokens.copy_(torch.cat([torch.tensor([last]), tree.tokens])[None])
        inputs.tree.copy_(anc)
        out = verify()
        end, accepted, following, _ = greedy_walk_on_device(tree.tokens, tree.parents, anc, depth, out[0])
        assert (int(end), int(accepted)) == (4, 2)  # root -> node 2 (token a) -> node 4 (token b)
        path = torch.sort(torch.where(anc[end], depth, 8 + depth)).indices[:3]
        static.cache.move(inputs.start, path[None], 3)
        reference = StaticModel(copy.deepcopy(target))
        reference.ready(1, 16)
        ref_logits = reference.prefill(torch.tensor([[1, 5, 9, 2, last, a, b]]), torch.tensor([7]))
    assert int(following) == int(ref_logits[0].argmax())  # the target's token after the path
    for mine, theirs in zip((*static.cache.keys, *static.cache.values),
                            (*reference.cache.keys, *reference.cache.values)):
        torch.testing.assert_close(mine[:, :, :7], theirs[:, :, :7], rtol=1e-5, atol=1e-5)


def test_static_tree_puts_parents_first_and_spends_the_budget():
    from pipeline.decode.medusa import static_tree

    tree = static_tree(12, num_heads=3)
    assert len(tree) == 12 and tree[0] == (0,)
    assert all(len(p) == 1 or p[:-1] in tree[: tree.index(p)] for p in tree)
    assert max(map(len, tree)) <= 3
