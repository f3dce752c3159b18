"""The decoder's contract on tiny and stub models: lossless greedy, exact bookkeeping, edge cases;
the static cache really used by the model; transformers' keywords on every supported version."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_llama
from pipeline.decode import ModelDrafter, NgramDrafter, StaticModel, plain_decode, speculative_decode
from pipeline.decode.ngram import lookup, lookup_on_device
from pipeline.kernels.linear import onednn_available, onednn_dtypes

VOCAB, EOS = 32, 31


class StubLM(torch.nn.Module):
    """Logits fixed by a rule next_token(token, position): never random, never learned.

    It ignores the static cache (and the static step that says where its slots are), so only
    the decoder's and the drafter's position and length bookkeeping is exercised.
    """

    def __init__(self, rule):
        super().__init__()
        self.rule = rule
        self.config = LlamaConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the decoder a device and a dtype
        self.calls = []

    def logits(self, input_ids, position_ids):
        nxt = self.rule(input_ids, position_ids)  # [B, S]
        logits = torch.full((*input_ids.shape, VOCAB), -10.0)
        return logits.scatter_(2, nxt[..., None], 10.0)

    def forward(self, input_ids, position_ids=None, use_cache=False, static_step=None, logits_to_keep=0, **kwargs):
        assert static_step is not None and not use_cache  # the decoder's static forwards only
        self.calls.append(input_ids.shape[1])
        return type("Out", (), {"logits": keep(self.logits(input_ids, position_ids), logits_to_keep)})()


def keep(logits, logits_to_keep):
    """transformers' logits_to_keep: the last n positions (0: all), or a tensor of positions."""
    if isinstance(logits_to_keep, torch.Tensor):
        return logits[:, logits_to_keep]
    return logits[:, -logits_to_keep:] if logits_to_keep else logits


def count_up(ids, pos):  # the target: t -> t + 1, EOS after 20
    return torch.where(ids >= 20, torch.full_like(ids, EOS), ids % 30 + 1)


def count_up_by_two(ids, pos):
    return (ids + 2) % 30 + 1


def wrong_at_every_third_position(ids, pos):
    return torch.where(pos % 3 == 2, (ids + 5) % 30 + 1, count_up(ids, pos))


def run(target_rule, drafter, prompts, k, max_new_tokens=40):
    target = StubLM(target_rule)
    result = speculative_decode(StaticModel(target), drafter, prompts, num_draft_tokens=k,
                                max_new_tokens=max_new_tokens, eos_ids={EOS})
    plain = plain_decode(StaticModel(StubLM(target_rule)), prompts, max_new_tokens=max_new_tokens, eos_ids={EOS})
    return result, plain, target


def test_always_accepting_draft_emits_k_plus_one_tokens_per_pass():
    result, plain, target = run(count_up, ModelDrafter(StubLM(count_up)), [[1, 2]], k=4)
    assert result.tokens == plain.tokens == [list(range(3, 21)) + [EOS]]  # 19 tokens
    # Prefill gives 1 token, then each pass 5: 1 + 5 + 5 + 5 + (3, stopped by EOS) = 19 in 5 passes.
    assert result.target_passes == [5]
    assert target.calls == [2, 5, 5, 5, 5]
    assert result.acceptance_by_position == [1.0, 1.0, 1.0, 1.0]


def test_never_accepting_draft_still_emits_one_target_token_per_pass():
    result, plain, _ = run(count_up, ModelDrafter(StubLM(count_up_by_two)), [[1, 2]], k=3)
    assert result.tokens == plain.tokens
    assert result.target_passes == [len(plain.tokens[0])]  # tau == 1
    assert result.acceptance_by_position[0] == 0.0
    assert result.proposed_by_position[0] == len(plain.tokens[0]) - 1  # every pass after the prefill
    assert not any(result.proposed_by_position[1:])  # later positions are never reached


def test_per_position_counts_have_one_entry_per_draft_position():
    result, _, _ = run(count_up, ModelDrafter(StubLM(count_up_by_two)), [[1, 2]], k=3)
    assert result.acceptance_by_position == [0.0, 0.0, 0.0]
    assert result.proposed_by_position[1:] == [0, 0]


def test_partially_accepting_draft():
    result, plain, _ = run(count_up, ModelDrafter(StubLM(wrong_at_every_third_position)), [[1, 2]], k=4)
    assert result.tokens == plain.tokens
    alphas = result.acceptance_by_position
    assert 0 < alphas[0] < 1 and result.tau > 1.0


def test_eos_inside_an_accepted_chunk_ends_the_output():
    # The draft agrees with the target, so the chunk that contains EOS is accepted whole;
    # nothing after EOS may be emitted.
    result, plain, _ = run(count_up, ModelDrafter(StubLM(count_up)), [[17]], k=6)
    assert result.tokens == [[18, 19, 20, EOS]] == plain.tokens


def test_max_new_tokens_inside_a_chunk():
    result, plain, _ = run(count_up, ModelDrafter(StubLM(count_up)), [[1]], k=5, max_new_tokens=7)
    assert result.tokens == plain.tokens == [[2, 3, 4, 5, 6, 7, 8]]


def test_rows_of_a_batch_accept_different_lengths():
    prompts = [[1, 2], [5], [3, 4, 5, 6], [18]]  # rows of different lengths, one early EOS
    drafter = ModelDrafter(StubLM(wrong_at_every_third_position))
    result, plain, _ = run(count_up, drafter, prompts, k=3)
    assert result.tokens == plain.tokens
    assert result.tokens[3] == [19, 20, EOS]


class UnsureLM(StubLM):
    """StubLM whose choice is the rule's but held with probability ~0.05 at every fourth position."""

    def logits(self, input_ids, position_ids):
        logits = super().logits(input_ids, position_ids)
        unsure = (position_ids % 4 == 3)[..., None] & (logits > 0)
        return torch.where(unsure, torch.full_like(logits, -9.5), logits)


@pytest.mark.parametrize("prompts", [[[1, 2]], [[1, 2], [5], [3, 4, 5, 6]]])
def test_confidence_threshold_ends_chains_at_unsure_tokens(prompts):
    # The draft is always right, but unsure at every fourth position: with a threshold each
    # chain ends at its first unsure token, so no chain is longer than 4 of the 6 allowed.
    sure, plain, _ = run(count_up, ModelDrafter(StubLM(count_up), confidence_threshold=0.5), prompts, k=6)
    assert sure.tokens == plain.tokens and sure.proposed_by_position[3] > 0  # a sure draft is never stopped
    result, plain, target = run(count_up, ModelDrafter(UnsureLM(count_up), confidence_threshold=0.5), prompts, k=6)
    assert result.tokens == plain.tokens
    assert not any(result.proposed_by_position[4:]) and result.proposed_by_position[2] > 0
    assert all(a == 1.0 for a in result.acceptance_by_position[:3])
    # without graphs the target verifies only as many drafts as some row proposed: the last
    # token and at most 4 proposals per pass
    assert max(target.calls[1:]) <= 5
    unstopped, _, _ = run(count_up, ModelDrafter(UnsureLM(count_up)), prompts, k=6)
    assert unstopped.tokens == plain.tokens and unstopped.proposed_by_position[5] > 0


def test_a_pass_without_proposals_verifies_only_the_last_token():
    """On a CPU (no captured shape to keep) the verification is as wide as the longest proposal:
    prompt lookup finds nothing in a sequence that never repeats, so every pass is plain."""
    result, plain, target = run(count_up, NgramDrafter(), [[1, 2], [5]], k=4)
    assert result.tokens == plain.tokens
    assert target.calls == [2] + [1] * (len(plain.tokens[0]) - 1)
    assert result.tau == 1.0 and not any(result.proposed_by_position)


def test_ngram_lookup_prefers_the_longest_latest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    assert lookup(seq, 2, max_ngram=3, min_ngram=1) == [7, 5]  # "2 3" last seen before 7
    assert lookup([4, 5, 6], 3, max_ngram=3, min_ngram=1) == []
    assert lookup([1, 2, 1], 3, max_ngram=2, min_ngram=1) == [2, 1]


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (3, 2), (2, 1)])
def test_ngram_lookup_on_device_follows_the_host_rule(max_ngram, min_ngram):
    """lookup_on_device (every row at once, rows right-padded with stale entries) proposes what
    lookup, its reference, proposes for each row alone."""
    seqs = [[1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], [4, 5, 6], [1, 2, 1], [7, 7, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
            [8], [2, 4, 2, 4, 2]]
    width, k = 16, 3
    tokens = torch.randint(0, VOCAB, (len(seqs), width), generator=torch.Generator().manual_seed(0))  # stale
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in seqs])
    proposals, num = lookup_on_device(tokens, lengths, k, max_ngram, min_ngram)
    assert proposals.shape == (len(seqs), k)
    for row, s in enumerate(seqs):
        want = lookup(s, k, max_ngram, min_ngram)
        assert proposals[row, : num[row]].tolist() == want, (row, s)


def test_ngram_drafter_on_a_repeating_target():
    # The target repeats a cycle, which prompt lookup predicts perfectly once it has seen it.
    cycle = lambda ids, pos: torch.where(ids >= 6, torch.ones_like(ids), ids + 1)
    result, plain, _ = run(cycle, NgramDrafter(), [[1, 2, 3, 4, 5, 6, 1]], k=4, max_new_tokens=30)
    assert result.tokens == plain.tokens
    assert result.tau > 4.0


def restricted(model, ids):
    from pipeline.decode.prepare import restrict_vocabulary

    draft = copy.deepcopy(model)
    restrict_vocabulary(draft, torch.tensor(ids))
    return draft


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("drafter_kind", ["ngram", "draft_model", "self", "self_permuted_vocab", "draft_vocab",
                                          "draft_model_stopping", "self_stopping"])
def test_greedy_output_equals_plain_decoding_on_a_tiny_llama(k, drafter_kind):
    target = tiny_llama(0)
    prompts = [[3, 7, 1, 9, 3, 7], [5, 2], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 8]]
    drafter = {"ngram": lambda: NgramDrafter(), "draft_model": lambda: ModelDrafter(tiny_llama(1, layers=1)),
               "self": lambda: ModelDrafter(target),
               # the target's own LM head rows in another order: every proposal maps back right
               "self_permuted_vocab": lambda: ModelDrafter(restricted(target, torch.randperm(VOCAB).tolist())),
               # half the vocabulary: proposals stay within it, outputs stay the target's
               "draft_vocab": lambda: ModelDrafter(restricted(target, list(range(0, VOCAB, 2)))),
               # chains that end at the draft's first token below a probability (the tiny target's
               # choices have 0.03-0.06): rows and steps end at different lengths
               "draft_model_stopping": lambda: ModelDrafter(tiny_llama(1, layers=1), confidence_threshold=0.04),
               "self_stopping": lambda: ModelDrafter(target, confidence_threshold=0.04),
               }[drafter_kind]()
    static = StaticModel(target)
    spec = speculative_decode(static, drafter, prompts, num_draft_tokens=k, max_new_tokens=30, eos_ids={EOS})
    for row, prompt in enumerate(prompts):
        alone = plain_decode(static, [prompt], max_new_tokens=30, eos_ids={EOS})
        assert spec.tokens[row] == alone.tokens[0]
    if drafter_kind in ("self", "self_permuted_vocab"):  # a draft identical to the target accepts everything
        assert all(a == 1.0 for a in spec.acceptance_by_position)
    if drafter_kind == "self_stopping":  # everything it proposes (a position never reached reads 0)
        assert all(a == p for a, p in zip(spec.accepted_by_position, spec.proposed_by_position))
    if drafter_kind == "self_stopping" and k > 1:  # some chains ended early, some did not
        assert 0 < spec.proposed_by_position[1] < spec.proposed_by_position[0]
    if drafter_kind == "draft_vocab":  # accepted where the target's token is even, never elsewhere
        assert 0 < spec.acceptance_by_position[0] < 1


def test_plain_decoding_equals_hf_generate_on_a_tiny_llama():
    """Batched, rows of different lengths, against HF generate on each prompt alone (the same
    model object, switched to our static attention: called without a static step it runs
    transformers' sdpa attention)."""
    target = tiny_llama(0)
    prompts = [[3, 7, 1, 9], [5, 2], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 8]]
    ours = plain_decode(StaticModel(target), prompts, max_new_tokens=25, eos_ids={EOS}).tokens
    for prompt, mine in zip(prompts, ours):
        with torch.inference_mode():
            hf = target.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
        assert mine == (hf[: hf.index(EOS) + 1] if EOS in hf else hf)


def test_the_model_really_reads_and_writes_our_static_cache():
    """transformers hands our `static_step` keyword to the attention layers only under our
    attention implementation; a keyword the installed version dropped would run every forward
    without the cache, batch size 1 decoding garbage that plain and speculative agree on. The
    prefill writes the prompt's slots only, a verification reads them (its logits are a full
    forward's) and writes its own, and corrupting the cached keys changes its output."""
    model = tiny_llama(0)
    seq = torch.tensor([[4, 9, 2, 7, 1]])
    with torch.inference_mode():
        full = model(seq).logits
        static = StaticModel(model)
        static.ready(1, 8)
        static.prefill(seq[:, :3], torch.tensor([3]))
        for layer in (*static.cache.keys, *static.cache.values):
            assert layer[:, :, :3].abs().sum(dim=-1).gt(0).all() and not layer[:, :, 3:].any()
        verify, inputs = static.replay(2)
        inputs.start.fill_(3)
        inputs.positions.copy_(torch.tensor([[3, 4]]))
        inputs.tokens.copy_(seq[:, 3:])
        torch.testing.assert_close(verify(), full[:, 3:], atol=1e-5, rtol=1e-4)
        for layer in (*static.cache.keys, *static.cache.values):
            assert layer[:, :, :5].abs().sum(dim=-1).gt(0).all() and not layer[:, :, 5:].any()
        for layer in static.cache.keys:
            layer[:, :, :3] = torch.randn_like(layer[:, :, :3])
        assert not torch.allclose(verify(), full[:, 3:], atol=1e-3)


def test_rejected_slots_are_written_over_per_row():
    """Rolling back a rejected draft costs nothing: rows keep different numbers of a verified
    chunk, and the next forward (other tokens) writes over each row's stale slots from its own
    length; its logits are a full forward's of each row's committed tokens."""
    model = tiny_llama(0)
    seqs = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]])
    with torch.inference_mode():
        static = StaticModel(model)
        static.ready(2, 10)
        static.prefill(seqs[:, :3], torch.tensor([3, 3]))
        verify, inputs = static.replay(3)
        inputs.start.fill_(3)
        inputs.positions.copy_(torch.arange(3, 6).expand(2, 3))
        inputs.tokens.copy_(seqs[:, 3:6])
        verify()
        kept = torch.tensor([4, 5])  # row 0 keeps 1 of the 3, row 1 keeps 2
        nxt = torch.tensor([[11, 12], [13, 14]])  # not the tokens whose keys those slots hold
        step, inputs = static.replay(2)
        inputs.start.copy_(kept)
        inputs.positions.copy_(kept[:, None] + torch.arange(2))
        inputs.tokens.copy_(nxt)
        logits = step()
        for row in range(2):
            committed = torch.cat([seqs[row, : kept[row]], nxt[row]])[None]
            torch.testing.assert_close(logits[row], model(committed).logits[0, -2:], atol=1e-5, rtol=1e-4)


def test_static_attention_reads_grouped_kv_heads_without_copies(monkeypatch):
    """The static attention reads the cache's grouped key/value heads as they are (SDPA's
    enable_gqa or the tree-attention kernel): a verification of rows at different lengths gives
    transformers' sdpa logits without its per-head copy of the cache (repeat_kv)."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    model = tiny_llama(0)  # 4 query heads over 2 key/value heads
    seqs = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([6, 4])
    with torch.inference_mode():
        full = [model(seqs[row : row + 1, : lengths[row] + 3]).logits[0, -3:] for row in range(2)]
        static = StaticModel(model)
        static.ready(2, 12)
        static.prefill(seqs, lengths)
        verify, inputs = static.replay(3)
        inputs.start.copy_(lengths)
        inputs.positions.copy_(lengths[:, None] + torch.arange(3))
        inputs.tokens.copy_(seqs.gather(1, inputs.positions))
        copies = []
        real = hf_sdpa.repeat_kv
        monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: copies.append(1) or real(*a))
        logits = verify()
    assert copies == []
    for row in range(2):
        torch.testing.assert_close(logits[row], full[row], rtol=1e-5, atol=1e-5)


def test_with_cache_hands_the_model_our_cache():
    """transformers renamed forward's cache keyword (past_key_values -> cache in 5.24); a name
    the installed version does not take vanishes into **kwargs and the model would run without
    the cache (heads/models.py and eval/engine.py pass theirs through with_cache)."""
    from transformers import DynamicCache

    from pipeline.decode.static_kv import with_cache

    model = tiny_llama(0)
    cache = DynamicCache(config=model.config)
    seq = torch.tensor([[4, 9, 2, 7, 1]])
    with torch.inference_mode():
        model(seq[:, :3], use_cache=True, **with_cache(model, cache))
        assert cache.get_seq_length() == 3
        logits = model(seq[:, 3:], use_cache=True, **with_cache(model, cache)).logits
        assert cache.get_seq_length() == 5
        torch.testing.assert_close(logits, model(seq).logits[:, 3:], atol=1e-5, rtol=1e-4)


def test_selected_hidden_states_are_at_their_indices():
    """Heads read target hidden states by output_hidden_states index (negative from the end),
    on every transformers version we support (5.23 changed how a list of indices selects)."""
    from pipeline.decode.static_kv import with_hidden_states

    model = tiny_llama(0, layers=3)
    seq = torch.tensor([[4, 9, 2, 7, 1]])
    with torch.inference_mode():
        every = model(seq, output_hidden_states=True).hidden_states
        some = model(seq, **with_hidden_states([1, -1])).hidden_states
    torch.testing.assert_close(some[1], every[1])
    torch.testing.assert_close(some[-1], every[-1])
    assert with_hidden_states([]) == {}


def test_static_prefill_hands_drafters_the_selected_hidden_states():
    """The hidden states a drafter reads (feature_layers) come from the static prefill and
    verification at their output_hidden_states indices, concatenated, at every position."""
    model = tiny_llama(0, layers=3)
    seqs = torch.tensor([[4, 9, 2, 7, 1], [3, 5, 8, 0, 0]])
    lengths = torch.tensor([5, 3])
    with torch.inference_mode():
        every = [model(seqs[row : row + 1, : lengths[row]], output_hidden_states=True).hidden_states
                 for row in range(2)]
        static = StaticModel(model)
        static.ready(2, 8)
        logits, features = static.prefill(seqs, lengths, layers=(1, -1))
    assert features.shape == (2, 5, 2 * 32)
    for row in range(2):
        n = int(lengths[row])
        want = torch.cat([every[row][1][0], every[row][-1][0]], dim=-1)
        torch.testing.assert_close(features[row, :n], want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(logits[row], model(seqs[row : row + 1, :n]).logits[0, -1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("product", [None, "linear", "columns", "onednn"])
def test_small_batch_linear_matches_nn_linear(product, monkeypatch):
    from pipeline.kernels import linear
    from pipeline.kernels.linear import MAX_ROWS, SmallBatchLinear

    monkeypatch.setattr(linear, "FORCE", product)  # None: the product measured fastest here
    torch.manual_seed(0)
    for bias in (False, True):
        plain = torch.nn.Linear(48, 80, bias=bias)
        fast = copy.deepcopy(plain)
        fast.__class__ = SmallBatchLinear
        for shape in [(1, 48), (1, 1, 48), (2, 3, 48), (5, 48), (1, MAX_ROWS + 1, 48), (0, 48)]:
            x = torch.randn(shape)
            with torch.inference_mode():
                torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-6)
        x = torch.randn(3, 48, requires_grad=True)  # gradients flow through the small-batch product
        fast(x).sum().backward()
        assert x.grad is not None and fast.weight.grad is not None


@pytest.mark.skipif(not onednn_available(), reason="PyTorch built without oneDNN")
def test_small_batch_linear_onednn_copy_follows_the_weight(monkeypatch):
    from pipeline.kernels import linear
    from pipeline.kernels.linear import SmallBatchLinear

    monkeypatch.setattr(linear, "FORCE", "onednn")
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 80)
    fast = copy.deepcopy(plain)
    fast.__class__ = SmallBatchLinear
    x = torch.randn(2, 3, 48)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-6)
    assert "_onednn" in fast.__dict__  # the oneDNN product ran, on a reordered copy of the weight
    with torch.no_grad():  # an in-place update (an optimiser step) must not leave the copy stale
        fast.weight.mul_(-2.0)
        plain.weight.mul_(-2.0)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-6)
    twin = copy.deepcopy(fast)  # copies leave the opaque oneDNN tensor behind and make their own
    assert "_onednn" not in twin.__dict__
    twin.bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(twin(x.bfloat16()), torch.nn.functional.linear(
            x.bfloat16(), plain.weight.bfloat16(), plain.bias.bfloat16()), rtol=2e-2, atol=2e-2)
    # bf16 goes through oneDNN only on a CPU with bf16 instructions; elsewhere (AVX2) the
    # reorder would raise, so the layer falls back to the plain product
    assert ("_onednn" in twin.__dict__) == (torch.bfloat16 in onednn_dtypes())


def test_decode_layout_keeps_the_function():
    from pipeline.kernels.linear import decode_layout, is_decode_layout

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[3, 7, 1, 9, 3, 7, 2]])
    prompts = [[3, 7, 1, 9, 3, 7], [5, 2]]
    with torch.inference_mode():
        before = model(ids).logits
    plain = plain_decode(StaticModel(copy.deepcopy(model)), prompts, max_new_tokens=20, eos_ids={EOS})
    assert not is_decode_layout(model)
    assert decode_layout(model) == 2 * 7 + 1  # 7 projections per layer and the (tied) LM head once
    assert is_decode_layout(model) and decode_layout(model) == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert model.lm_head.weight.shape == (VOCAB, 32)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    static = StaticModel(model)
    spec = speculative_decode(static, NgramDrafter(), prompts, num_draft_tokens=3, max_new_tokens=20, eos_ids={EOS})
    assert spec.tokens == plain.tokens  # the layout's greedy outputs are the plain layout's
    assert plain_decode(static, prompts, max_new_tokens=20, eos_ids={EOS}).tokens == plain.tokens


def test_int8_linears_keep_greedy_outputs():
    """eval runs a draft's CPU linear layers in int8 (kernels/linear.py): its logits move a
    little, every linear layer (the tied LM head once) changes, nothing else does, and greedy
    speculative decoding with it still emits exactly the target's plain greedy tokens."""
    from pipeline.kernels.linear import decode_layout, int8_linears

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         initializer_range=0.3)  # large weights: varied text, not one token repeated
    target = LlamaForCausalLM(config).eval()
    draft = copy.deepcopy(target)  # the target a little perturbed: accepted runs and rejections
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.03)
    ids = torch.tensor([[3, 7, 1, 9, 3, 7, 2]])
    with torch.inference_mode():
        before = draft(ids).logits
    assert int8_linears(draft) == 2 * 7 + 1
    assert int8_linears(draft) == 0 and decode_layout(draft) == 0  # nothing left to change
    assert not any(type(m) is torch.nn.Linear for m in draft.modules())
    assert isinstance(draft.model.embed_tokens, torch.nn.Embedding)  # embeddings stay fp32
    with torch.inference_mode():
        after = draft(ids).logits
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, before, rtol=0.0, atol=0.1 * before.abs().max().item())
    prompts = [[3, 7, 1, 9, 3, 7], [5, 2]]
    static = StaticModel(target)
    plain = plain_decode(static, prompts, max_new_tokens=30, eos_ids={EOS})
    for k in (1, 4):
        spec = speculative_decode(static, ModelDrafter(draft), prompts, num_draft_tokens=k, max_new_tokens=30,
                                  eos_ids={EOS})
        assert spec.tokens == plain.tokens
        assert sum(spec.accepted_by_position) > 0 and spec.accepted_by_position[0] < spec.proposed_by_position[0]
