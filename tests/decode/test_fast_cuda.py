"""The decoder on a CUDA GPU, with CUDA graphs and the compiled Triton kernels (skipped
without CUDA; `make gpu-check` runs them): in fp32 with TF32 off greedy outputs equal plain
decoding token for token; in bf16 every difference from plain bf16 decoding is at a near-tie;
graph replays give what the same forwards give without graphs."""

import copy

import pytest
import torch

from conftest import tiny_llama
from pipeline.decode import ModelDrafter, NgramDrafter, StaticModel, plain_decode, speculative_decode
from pipeline.eval.measure import tie_epsilon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
EOS = 31
PROMPTS = [[3, 7, 1, 9, 3, 7], [5, 2], [8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 8], [4, 4]]


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def on_gpu(model, dtype=torch.float32):
    return model.to("cuda", dtype)  # StaticModel switches it to the static attention


def drafters(target):
    return {"ngram": NgramDrafter(),
            "draft_model": ModelDrafter(on_gpu(tiny_llama(1, layers=1)), graphs=True),
            "self": ModelDrafter(on_gpu(copy.deepcopy(target).float()), graphs=True)}


@pytest.mark.parametrize("k", [1, 4])
def test_fp32_graphs_equal_plain_decoding_token_for_token(k):
    target = on_gpu(tiny_llama(0))
    alone = StaticModel(target, graphs=False)  # each prompt alone, without graphs
    expected = [plain_decode(alone, [p], max_new_tokens=40, eos_ids={EOS}).tokens[0] for p in PROMPTS]
    fast = StaticModel(target, graphs=True)
    assert plain_decode(fast, PROMPTS, max_new_tokens=40, eos_ids={EOS}).tokens == expected
    for name, drafter in drafters(target).items():
        out = speculative_decode(fast, drafter, PROMPTS, num_draft_tokens=k, max_new_tokens=40, eos_ids={EOS})
        assert out.tokens == expected, name
    # the verification really was a graph replay, at the fixed width k + 1 (replay() returns the
    # forward already made for that width, or a new one never captured)
    assert fast.replay(k + 1)[0].captured is not None


def test_graph_replays_equal_the_same_forwards_without_graphs():
    target = on_gpu(tiny_llama(0))
    drafter = lambda graphs: ModelDrafter(on_gpu(tiny_llama(1, layers=1)), graphs=graphs)
    with_graphs = speculative_decode(StaticModel(target, True), drafter(True), PROMPTS, num_draft_tokens=3,
                                     max_new_tokens=40, eos_ids={EOS})
    without = speculative_decode(StaticModel(target, False), drafter(False), PROMPTS, num_draft_tokens=3,
                                 max_new_tokens=40, eos_ids={EOS})
    assert with_graphs.tokens == without.tokens
    assert with_graphs.accepted_by_position == without.accepted_by_position


def test_bf16_differences_from_plain_bf16_decoding_are_near_ties():
    """Kernels of different widths round differently in bf16; where a method's token differs
    from plain bf16 decoding, plain's top-2 logits there are within tie_epsilon(bf16)."""
    target = on_gpu(tiny_llama(0), torch.bfloat16)
    fast = StaticModel(target, graphs=True)
    plain = plain_decode(fast, PROMPTS, max_new_tokens=40, eos_ids={EOS}).tokens
    epsilon = tie_epsilon(torch.bfloat16)
    for drafter in (NgramDrafter(), ModelDrafter(on_gpu(tiny_llama(1, layers=1), torch.bfloat16), graphs=True)):
        out = speculative_decode(fast, drafter, PROMPTS, num_draft_tokens=4, max_new_tokens=40, eos_ids={EOS}).tokens
        for prompt, want, got in zip(PROMPTS, plain, out):
            if want == got:
                continue
            i = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
            with torch.inference_mode():
                logits = target(torch.tensor([prompt + want[:i]], device="cuda")).logits[0, -1].float()
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] < epsilon, (drafter.name, i, top2.tolist())


def test_sampling_on_cuda_matches_the_cpu_reference_rule():
    """The fused sampling kernel on CUDA tensors against its PyTorch reference on the same draws."""
    from pipeline.kernels.acceptance import accept_sampling_reference
    from pipeline.kernels.acceptance_triton import accept_sampling_triton

    gen = torch.Generator().manual_seed(0)
    b, k, v = 64, 4, 49152
    p = torch.softmax(3 * torch.randn((b, k + 1, v), generator=gen), dim=-1)
    q = 0.8 * p[:, :k] + 0.2 * torch.softmax(3 * torch.randn((b, k, v), generator=gen), dim=-1)
    draft = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, k)
    case = (draft, torch.full((b,), k), q, p, torch.rand((b, k), generator=gen), torch.rand(b, generator=gen))
    want = accept_sampling_reference(*case)
    got = accept_sampling_triton(*(x.cuda() for x in case))
    assert torch.equal(got[0].cpu(), want[0])
    assert (got[1].cpu() == want[1]).float().mean() > 0.999  # a draw at a float boundary may round apart
