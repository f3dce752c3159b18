"""Tree attention over a static cache: the Triton kernel equals the PyTorch reference (random
shapes, grouped heads, rows of different lengths, chains and random trees, fp32 and bf16),
and the reference's mask is what the docstring says."""

import pytest
import torch

from conftest import kernel_device, triton_module
from pipeline.kernels.tree_attention import tree_attention_reference, visible_slots


@pytest.fixture(scope="module")
def kernels():
    return triton_module("pipeline.kernels.tree_attention_triton")


def random_tree(width: int, gen: torch.Generator) -> torch.Tensor:
    """[W, W] ancestors (self included) of a random tree whose node 0 is the root and whose
    nodes come after their parents."""
    ancestors = torch.eye(width, dtype=torch.bool)
    for node in range(1, width):
        parent = int(torch.randint(0, node, (1,), generator=gen))
        ancestors[node] |= ancestors[parent]
    return ancestors


def test_visible_slots_follow_the_lengths_and_the_tree():
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2's parent is 0
    mask = visible_slots(torch.tensor([2, 0]), tree, 3, 6)
    assert mask[0].int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]]
    assert mask[1].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0]]
    causal = visible_slots(torch.tensor([1]), None, 2, 4)
    assert causal[0].int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]


@pytest.mark.parametrize("b, hq, hkv, w, d, t", [(2, 4, 2, 1, 16, 40), (3, 9, 3, 5, 64, 100), (1, 3, 3, 17, 32, 80),
                                                 (2, 8, 1, 3, 64, 70), (1, 9, 3, 33, 64, 200)])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference(kernels, b, hq, hkv, w, d, t, shape, dtype):
    gen = torch.Generator().manual_seed(b * 1000 + w * 10 + d)
    q, k, v = (torch.randn(shape_, generator=gen).to(dtype) for shape_ in ((b, hq, w, d), (b, hkv, t, d), (b, hkv, t, d)))
    lengths = torch.randint(0, t - w + 1, (b,), generator=gen)
    lengths[0] = t - w  # one row fills the cache to its end
    tree = random_tree(w, gen) if shape == "tree" else None
    want = tree_attention_reference(q.float(), k.float(), v.float(), lengths, tree, d ** -0.5)
    dev = kernel_device()
    got = kernels.tree_attention_triton(q.to(dev), k.to(dev), v.to(dev), lengths.to(dev),
                                        None if tree is None else tree.to(dev), d ** -0.5)
    assert got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


def test_stale_slots_past_the_new_tokens_are_never_read(kernels):
    """Slots past lengths + w hold garbage (a rejected branch, NaN even): the output ignores them."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn((1, 2, 2, 16), generator=gen), torch.randn((1, 2, 20, 16), generator=gen), \
        torch.randn((1, 2, 20, 16), generator=gen)
    lengths = torch.tensor([5])
    clean = tree_attention_reference(q, k, v, lengths, None, 0.25)
    k[:, :, 7:], v[:, :, 7:] = float("nan"), float("nan")
    dev = kernel_device()
    got = kernels.tree_attention_triton(q.to(dev), k.to(dev), v.to(dev), lengths.to(dev), None, 0.25)
    torch.testing.assert_close(got.cpu(), clean, atol=2e-5, rtol=2e-5)
