"""The decoder (static caches, fixed shapes, fused acceptance) on CPU: the same code that CUDA
replays from graphs. Greedy outputs equal plain decoding (itself HF generate's) for every
drafter and k, rows of a batch at different lengths; the caches are kept across calls; the
Triton kernels (interpreted here) give the same outputs as the PyTorch references; a model
switched to the static attention still runs transformers' own paths without it; continuous
batching answers as plain decoding does."""

import copy

import pytest
import torch

from conftest import tiny_llama
from pipeline.decode import (ModelDrafter, NgramDrafter, StaticModel, continuous_decode, plain_decode,
                             speculative_decode)
from pipeline.decode.prepare import restrict_vocabulary
from pipeline.decode.static_kv import ATTENTION, Replay, StaticCache

EOS = 31
PROMPTS = [[3, 7, 1, 9, 3, 7], [5, 2], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 8]]


def plain_outputs(target, prompts, max_new_tokens=30):
    """Each prompt decoded alone."""
    static = StaticModel(target)
    return [plain_decode(static, [p], max_new_tokens=max_new_tokens, eos_ids={EOS}).tokens[0] for p in prompts]


@pytest.fixture(scope="module")
def target_and_plain():
    target = tiny_llama(0)
    expected = plain_outputs(target, PROMPTS)
    assert target.config._attn_implementation == ATTENTION  # StaticModel switched it
    return target, expected


def drafter_of(kind: str, target):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "draft_model":
        return ModelDrafter(tiny_llama(1, layers=1))
    if kind == "self":  # the target drafting for itself: every proposal is accepted
        return ModelDrafter(copy.deepcopy(target))
    if kind == "draft_vocab":  # proposals from half the vocabulary
        draft = copy.deepcopy(target)
        restrict_vocabulary(draft, torch.arange(0, 32, 2))
        return ModelDrafter(draft)
    if kind == "stopping":  # chains that end at the draft's first unsure token
        return ModelDrafter(copy.deepcopy(target), confidence_threshold=0.04)
    raise ValueError(kind)


def test_batched_plain_decoding_equals_each_prompt_alone_and_hf_generate(target_and_plain):
    target, expected = target_and_plain
    out = speculative_decode(StaticModel(target, graphs=False), None, PROMPTS, num_draft_tokens=0,
                             max_new_tokens=30, eos_ids={EOS})
    assert out.tokens == expected
    assert out.tau == 1.0 and out.proposed_by_position == []
    assert plain_decode(StaticModel(target), PROMPTS, max_new_tokens=30, eos_ids={EOS}).tokens == expected
    fresh = tiny_llama(0)  # transformers' own attention, never switched
    for prompt, want in zip(PROMPTS, expected):
        with torch.inference_mode():
            hf = fresh.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=EOS,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert want == (hf[: hf.index(EOS) + 1] if EOS in hf else hf)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", ["ngram", "draft_model", "self", "draft_vocab", "stopping"])
def test_greedy_speculative_decoding_equals_plain_decoding(target_and_plain, kind, k):
    target, expected = target_and_plain
    out = speculative_decode(StaticModel(target, graphs=False), drafter_of(kind, target), PROMPTS, num_draft_tokens=k,
                      max_new_tokens=30, eos_ids={EOS})
    assert out.tokens == expected
    if kind == "self":
        assert all(a == 1.0 for a in out.acceptance_by_position)
        # the prefill's token, then k + 1 tokens a pass (the last pass may hold fewer)
        assert out.target_passes == [1 + -(-(len(e) - 1) // (k + 1)) for e in expected]
    if kind == "stopping" and k > 1:  # some chains ended early: fewer second positions than first
        assert 0 < out.proposed_by_position[1] < out.proposed_by_position[0]
    if kind in ("ngram", "draft_vocab"):
        assert 0 < sum(out.accepted_by_position) < sum(out.proposed_by_position)


def test_end_of_turn_and_max_new_tokens_inside_an_accepted_chain(target_and_plain):
    """A row stops at its end-of-turn token or budget even when more of the chain was accepted,
    and the batch goes on for the other rows (whose shapes do not change)."""
    target, _ = target_and_plain
    outputs = plain_outputs(target, PROMPTS, max_new_tokens=12)
    # an end-of-turn token that only row 0 emits, a few tokens in (after a first occurrence)
    eos, at = next((t, i) for i, t in enumerate(outputs[0]) if i >= 3 and t not in outputs[0][:i]
                   and all(t not in o for o in outputs[1:]))
    expected = [o[: o.index(eos) + 1] if eos in o else o for o in outputs]
    drafter = drafter_of("self", target)
    out = speculative_decode(StaticModel(target, graphs=False), drafter, PROMPTS, num_draft_tokens=4,
                             max_new_tokens=12, eos_ids={eos})
    assert out.tokens == expected
    assert len(out.tokens[0]) == at + 1 < 12 and max(map(len, out.tokens)) == 12


def test_caches_are_kept_across_calls_and_grow_when_needed(target_and_plain):
    target, expected = target_and_plain
    fast = StaticModel(target, graphs=False)
    drafter = ModelDrafter(tiny_llama(1, layers=1))
    speculative_decode(fast, drafter, PROMPTS, num_draft_tokens=3, max_new_tokens=30, eos_ids={EOS})
    cache, draft_cache, replay = fast.cache, drafter.static.cache, fast.replay(4)[0]
    again = speculative_decode(fast, drafter, PROMPTS[::-1], num_draft_tokens=3, max_new_tokens=30, eos_ids={EOS})
    assert again.tokens == expected[::-1]
    assert fast.cache is cache and drafter.static.cache is draft_cache and fast.replay(4)[0] is replay
    longer = speculative_decode(fast, drafter, PROMPTS, num_draft_tokens=3, max_new_tokens=300, eos_ids={EOS})
    assert fast.max_len >= 300 and fast.cache is not cache
    assert [t[:30] for t in longer.tokens] == expected


def test_triton_kernels_give_the_same_outputs(target_and_plain, monkeypatch):
    """The decoder with its Triton kernels (interpreted on CPU) decodes what it decodes with
    the PyTorch references: the kernels CUDA runs are the ones this checks."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is not on")
    target, expected = target_and_plain
    monkeypatch.setenv("SPECDRAFT_KERNELS", "triton")
    prompts = PROMPTS[:2]
    out = speculative_decode(StaticModel(target, graphs=False), drafter_of("draft_model", target), prompts,
                             num_draft_tokens=3, max_new_tokens=10, eos_ids={EOS})
    assert out.tokens == [e[:10] for e in expected[:2]]


def test_a_static_attention_model_still_runs_transformers_own_paths(target_and_plain):
    """HF generate and a plain forward on the same model object (eval shares it on CUDA) take
    transformers' sdpa attention when no static step is passed."""
    target, expected = target_and_plain
    prompt = PROMPTS[1]
    with torch.inference_mode():
        hf = target.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=EOS,
                             pad_token_id=0)[0, len(prompt):].tolist()
        fresh = tiny_llama(0)
        torch.testing.assert_close(target(torch.tensor([PROMPTS[0]])).logits, fresh(torch.tensor([PROMPTS[0]])).logits)
    assert hf == expected[1][: len(hf)]


def test_replay_without_graphs_calls_its_function_each_time():
    calls = []
    replay = Replay(lambda: calls.append(1) or torch.tensor(len(calls)), graph=False)
    assert replay().item() == 1 and replay().item() == 2


def test_static_cache_moves_a_path_of_slots_per_row():
    """A tree's accepted path (slots start + source[j]) made contiguous at start + j, per row,
    in every layer's keys and values alike."""
    model = tiny_llama(0)
    cache = StaticCache(model, 2, 10, torch.device("cpu"), torch.float32)
    layers = (*cache.keys, *cache.values)
    for i, layer in enumerate(layers):
        layer.copy_((torch.arange(10.0) + 100 * i)[None, None, :, None].expand_as(layer))
    cache.move(torch.tensor([2, 5]), torch.tensor([[0, 2, 3], [0, 1, 4]]), 3)
    for i, layer in enumerate(layers):
        assert (layer[0] - 100 * i)[0, :, 0].tolist() == [0, 1, 2, 4, 5, 5, 6, 7, 8, 9]
        assert (layer[1] - 100 * i)[1, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 9, 8, 9]
        assert (layer[0] == layer[0, :1, :, :1]).all()  # every head and feature alike


def test_a_split_target_keeps_each_layers_cache_beside_it():
    """device_map targets: each layer's keys and values on its layer's device."""
    model = tiny_llama(0)
    model.model.layers[1:].to("meta")
    cache = StaticCache(model, 1, 8, torch.device("cpu"), torch.float32)
    assert [k.device.type for k in cache.keys] == ["cpu"] + ["meta"] * (len(model.model.layers) - 1)
    assert [v.device.type for v in cache.values] == [k.device.type for k in cache.keys]
    cache.move(torch.tensor([1]), torch.tensor([[0, 2]]), 2)  # moves on each layer's device


@pytest.mark.parametrize("fixed_shapes", [False, True])
def test_continuous_batching_answers_every_prompt_once_as_plain_decoding_does(target_and_plain, fixed_shapes):
    """11 prompts through 3 rows: every prompt's answer is plain decoding's and its top-k logits
    are the target's (a teacher-forced forward of the answer), each reported once. At fixed
    shapes every step computes all 3 rows; otherwise only rows still decoding, one per token
    emitted after a prompt's first."""
    target, _ = target_and_plain
    prompts = [PROMPTS[i % 3][: 2 + i % 5] + [i % 7 + 1] for i in range(11)]
    max_new, eos = 14, 22  # ends some answers early
    fresh = tiny_llama(0)
    done, steps = [], []
    fast = StaticModel(target, graphs=False, fixed_shapes=fixed_shapes)
    hook = target.model.embed_tokens.register_forward_pre_hook(
        lambda _, args: steps.append(args[0].shape[0]) if args[0].shape[1] == 1 else None)
    try:
        out = continuous_decode(fast, prompts, batch_size=3, max_new_tokens=max_new, eos_ids={eos}, topk=4,
                                on_done=lambda i, tokens: done.append(i))
    finally:
        hook.remove()
    emitted = sum(map(len, out.tokens))
    if fixed_shapes:
        assert set(steps) == {3} and len(steps) >= (emitted - len(prompts)) / 3
    else:
        assert sum(steps) == emitted - len(prompts) and min(steps) < 3
    alone = StaticModel(copy.deepcopy(fresh))
    for i, p in enumerate(prompts):
        want = plain_decode(alone, [p], max_new_tokens=max_new, eos_ids={eos}).tokens[0]
        assert out.tokens[i] == want, i
        with torch.inference_mode():  # the logits each emitted token was chosen from
            logits = fresh(torch.tensor([p + want[:-1]])).logits[0, len(p) - 1 :].float()
        values, ids = logits.topk(4, dim=-1)
        assert out.topk_ids[i].dtype == torch.int32 and out.topk_ids[i].shape == (len(want), 4)
        assert torch.equal(out.topk_ids[i], ids.to(torch.int32)), i
        torch.testing.assert_close(out.topk_logits[i], values, atol=1e-4, rtol=1e-4)
    assert sorted(done) == list(range(11))
    assert any(len(t) < max_new for t in out.tokens)  # some answers ended at the end-of-turn token
    assert fast.batch == 3
