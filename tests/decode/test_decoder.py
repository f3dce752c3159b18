"""The decoder's contract on tiny and stub models: lossless greedy, exact bookkeeping, edge cases."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_llama
from pipeline.decode import ModelDrafter, NgramDrafter, plain_decode, speculative_decode
from pipeline.decode.ngram import lookup
from pipeline.decode.kv import SlotCache
from pipeline.kernels.linear import onednn_available, onednn_dtypes

VOCAB, EOS, PAD = 32, 31, 0


class StubLM(torch.nn.Module):
    """Logits fixed by a rule next_token(token, position): never random, never learned.

    It ignores its KV cache, so only the decoder's slot bookkeeping is exercised.
    """

    def __init__(self, rule):
        super().__init__()
        self.rule = rule
        self.config = LlamaConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the decoder a device
        self.calls = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True,
                logits_to_keep=0):
        self.calls.append(input_ids.shape[1])
        nxt = self.rule(input_ids, position_ids)  # [B, S]
        logits = torch.full((*input_ids.shape, VOCAB), -10.0)
        logits.scatter_(2, nxt[..., None], 10.0)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return type("Out", (), {"logits": logits})()


def count_up(ids, pos):  # the target: t -> t + 1, EOS after 20 (never emits PAD)
    return torch.where(ids >= 20, torch.full_like(ids, EOS), ids % 30 + 1)


def count_up_by_two(ids, pos):
    return (ids + 2) % 30 + 1


def wrong_at_every_third_position(ids, pos):
    return torch.where(pos % 3 == 2, (ids + 5) % 30 + 1, count_up(ids, pos))


def run(target_rule, drafter, prompts, k, max_new_tokens=40):
    target = StubLM(target_rule)
    result = speculative_decode(target, drafter, prompts, num_draft_tokens=k, max_new_tokens=max_new_tokens,
                                eos_ids={EOS}, pad_id=PAD)
    plain = plain_decode(StubLM(target_rule), prompts, max_new_tokens=max_new_tokens, eos_ids={EOS}, pad_id=PAD)
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
    assert result.acceptance_by_position == [0.0, 0.0, 0.0]
    assert result.proposed_by_position[1:] == [0, 0]  # later positions are never reached


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
    prompts = [[1, 2], [5], [3, 4, 5, 6], [18]]  # left padding, different lengths, one early EOS
    drafter = ModelDrafter(StubLM(wrong_at_every_third_position))
    result, plain, _ = run(count_up, drafter, prompts, k=3)
    assert result.tokens == plain.tokens
    assert result.tokens[3] == [19, 20, EOS]


class UnsureLM(StubLM):
    """StubLM whose choice is the rule's but held with probability ~0.05 at every fourth position."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True,
                logits_to_keep=0):
        out = super().forward(input_ids, attention_mask, position_ids, cache, use_cache, 0)
        unsure = (position_ids % 4 == 3)[..., None] & (out.logits > 0)
        out.logits = torch.where(unsure, torch.full_like(out.logits, -9.5), out.logits)
        if logits_to_keep:
            out.logits = out.logits[:, -logits_to_keep:]
        return out


@pytest.mark.parametrize("prompts", [[[1, 2]], [[1, 2], [5], [3, 4, 5, 6]]])
def test_confidence_threshold_ends_chains_at_unsure_tokens(prompts):
    # The draft is always right, but unsure at every fourth position: with a threshold each
    # chain ends at its first unsure token, so no chain is longer than 4 of the 6 allowed.
    sure, plain, _ = run(count_up, ModelDrafter(StubLM(count_up), confidence_threshold=0.5), prompts, k=6)
    assert sure.tokens == plain.tokens and sure.proposed_by_position[3] > 0  # a sure draft is never stopped
    result, plain, target = run(count_up, ModelDrafter(UnsureLM(count_up), confidence_threshold=0.5), prompts, k=6)
    assert result.tokens == plain.tokens
    assert result.proposed_by_position[4:] == [0, 0] and result.proposed_by_position[2] > 0
    assert all(a == 1.0 for a in result.acceptance_by_position[:3])
    assert max(target.calls[1:]) <= 5  # the last token and at most 4 proposals verified per pass
    unstopped, _, _ = run(count_up, ModelDrafter(UnsureLM(count_up)), prompts, k=6)
    assert unstopped.tokens == plain.tokens and unstopped.proposed_by_position[5] > 0


def test_ngram_lookup_prefers_the_longest_latest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    assert lookup(seq, 2, max_ngram=3, min_ngram=1) == [7, 5]  # "2 3" last seen before 7
    assert lookup([4, 5, 6], 3, max_ngram=3, min_ngram=1) == []
    assert lookup([1, 2, 1], 3, max_ngram=2, min_ngram=1) == [2, 1]


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
    spec = speculative_decode(target, drafter, prompts, num_draft_tokens=k, max_new_tokens=30,
                              eos_ids={EOS}, pad_id=PAD)
    for row, prompt in enumerate(prompts):
        alone = plain_decode(target, [prompt], max_new_tokens=30, eos_ids={EOS}, pad_id=PAD)
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
    target = tiny_llama(0)
    prompt = [3, 7, 1, 9]
    ours = plain_decode(target, [prompt], max_new_tokens=25, eos_ids={EOS}, pad_id=PAD).tokens[0]
    with torch.inference_mode():
        hf = target.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False,
                             eos_token_id=EOS, pad_token_id=PAD)[0, len(prompt):].tolist()
    assert ours == hf[: hf.index(EOS) + 1] if EOS in hf else ours == hf


def test_the_model_really_reads_and_writes_our_cache():
    """transformers renamed forward's cache keyword (past_key_values -> cache in 5.24); a name
    the installed version does not take vanishes into **kwargs and every forward would run
    without the cache, batch size 1 decoding garbage that plain and speculative agree on."""
    model = tiny_llama(0)
    kv = SlotCache(model, 1, torch.device("cpu"))
    seq = torch.tensor([[4, 9, 2, 7, 1]])
    with torch.inference_mode():
        kv.forward(seq[:, :3])
        assert kv.cache.get_seq_length() == 3
        logits = kv.forward(seq[:, 3:])
        assert kv.cache.get_seq_length() == 5
        torch.testing.assert_close(logits, model(seq).logits[:, 3:], atol=1e-5, rtol=1e-4)


def test_selected_hidden_states_are_at_their_indices():
    """Heads read target hidden states by output_hidden_states index (negative from the end),
    on every transformers version we support (5.23 changed how a list of indices selects)."""
    from pipeline.decode.kv import with_hidden_states

    model = tiny_llama(0, layers=3)
    seq = torch.tensor([[4, 9, 2, 7, 1]])
    with torch.inference_mode():
        every = model(seq, output_hidden_states=True).hidden_states
        some = model(seq, **with_hidden_states([1, -1])).hidden_states
    torch.testing.assert_close(some[1], every[1])
    torch.testing.assert_close(some[-1], every[-1])
    assert with_hidden_states([]) == {}


def test_in_place_cache_matches_a_full_forward_after_crops_and_row_selection():
    model = tiny_llama(0)
    kv = SlotCache(model, 2, torch.device("cpu"))
    seqs = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]])
    with torch.inference_mode():
        kv.forward(seqs[:, :3])
        kv.forward(seqs[:, 3:6])
        kv.keep_last(torch.tensor([[True, False, False], [True, True, False]]))  # row 0 keeps 1 of 3
        assert kv.lengths.tolist() == [4, 5]
        kv.select_rows(torch.tensor([1]))
        logits = kv.forward(seqs[1:, 5:7])
        full = model(seqs[1:, :7]).logits
    torch.testing.assert_close(logits, full[:, 5:7], atol=1e-5, rtol=1e-4)


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
    with torch.inference_mode():
        before = model(ids).logits
    assert not is_decode_layout(model)
    assert decode_layout(model) == 2 * 7 + 1  # 7 projections per layer and the (tied) LM head once
    assert is_decode_layout(model) and decode_layout(model) == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert model.lm_head.weight.shape == (VOCAB, 32)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    prompts = [[3, 7, 1, 9, 3, 7], [5, 2]]
    spec = speculative_decode(model, NgramDrafter(), prompts, num_draft_tokens=3, max_new_tokens=20,
                              eos_ids={EOS}, pad_id=PAD)
    plain = plain_decode(model, prompts, max_new_tokens=20, eos_ids={EOS}, pad_id=PAD)
    assert spec.tokens == plain.tokens


def test_gqa_attention_reads_the_cache_without_copies(monkeypatch):
    """kernels/gqa_attention.py: a multi-token step after a cache (a verification), with and without
    padding, gives the logits of transformers' sdpa attention without its per-head copy of the
    cache (repeat_kv)."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    from pipeline.kernels.gqa_attention import gqa_attention

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    grouped = copy.deepcopy(model)
    assert gqa_attention(grouped) and grouped.config._attn_implementation != model.config._attn_implementation
    assert not gqa_attention(grouped)  # already switched
    seqs = torch.randint(0, VOCAB, (2, 9))
    prompt_valid = torch.ones((2, 6), dtype=torch.bool)
    prompt_valid[0, :2] = False  # a left-padded row: the cache needs a mask
    outputs = {}
    with torch.inference_mode():
        for name, m in (("sdpa", model), ("gqa", grouped)):
            kv = SlotCache(m, 2, torch.device("cpu"))
            kv.forward(seqs[:, :6], prompt_valid)
            copies = []
            real = hf_sdpa.repeat_kv
            monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: copies.append(1) or real(*a))
            outputs[name] = kv.forward(seqs[:, 6:])
            monkeypatch.setattr(hf_sdpa, "repeat_kv", real)
            outputs[name + "_copies"] = len(copies)
    torch.testing.assert_close(outputs["gqa"], outputs["sdpa"], rtol=1e-5, atol=1e-5)
    assert outputs["sdpa_copies"] == 2 * 2 and outputs["gqa_copies"] == 0  # keys and values, each layer


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
    for k in (1, 4):
        spec = speculative_decode(target, ModelDrafter(draft), prompts, num_draft_tokens=k, max_new_tokens=30,
                                  eos_ids={EOS}, pad_id=PAD)
        plain = plain_decode(target, prompts, max_new_tokens=30, eos_ids={EOS}, pad_id=PAD)
        assert spec.tokens == plain.tokens
        assert sum(spec.accepted_by_position) > 0 and spec.accepted_by_position[0] < spec.proposed_by_position[0]
