"""Flat model state in buckets (lightning_hdet._tensors): what a merge carries, one bucket at a time."""

import torch

from lightning_hdet._tensors import all_finite, assign_flat, buckets, flatten, reduced_buckets


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(10, 7, generator=gen), torch.randn(3, generator=gen).to(torch.bfloat16),
            torch.randn(4, 5, generator=gen).t(), torch.randn(40, generator=gen, dtype=torch.float64),
            torch.randn(25, generator=gen)]


def test_buckets_cover_every_value_once_within_the_byte_limit() -> None:
    tensors = _tensors()
    found = list(buckets(tensors, bucket_bytes=64))  # 16 float32 or 8 float64 values
    sizes = [(b.dtype, b.numel) for b in found]
    # 70 float32 values -> 16,16,16,16,6+3 (bf16 joins), the 20-value non-contiguous tensor whole,
    # then float64 in 8s, then the last float32 tensor in 16s
    assert sizes == [(torch.float32, 16)] * 4 + [(torch.float32, 9 + 20)] + [(torch.float64, 8)] * 5 + [
        (torch.float32, 16), (torch.float32, 9)]
    assert [b.offset for b in found] == [0, 16, 32, 48, 64, 93, 101, 109, 117, 125, 133, 149]
    flat = flatten(tensors)
    for b in found:
        torch.testing.assert_close(b.gather(), flat[b.offset : b.offset + b.numel].to(b.dtype), rtol=0, atol=0)


def test_blend_in_buckets_equals_the_flat_blend_bit_for_bit() -> None:
    """Two members averaged with coefficients (0.25, 0.75) and strength 0.5, in buckets and in one flat vector."""
    ours, other = _tensors()[:3] + _tensors()[4:], [t * 2 + 1 for t in _tensors()[:3] + _tensors()[4:]]
    reference = [t.clone() for t in ours]
    target = flatten(reference).mul_(0.25).add_(flatten(other).mul_(0.75))
    assign_flat(reference, target, 0.5)
    theirs = iter([b.gather().mul_(0.75) for b in buckets(other, bucket_bytes=32)])
    for bucket, flat in reduced_buckets(ours, 0.25, lambda x: x.add_(next(theirs)), bucket_bytes=32):
        bucket.scatter(flat, 0.5)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)


def test_zero_coefficient_contributes_exact_zeros_and_all_finite_sees_non_finite_values() -> None:
    tensors = _tensors()
    tensors[0][3, 2] = float("nan")
    assert not bool(all_finite(tensors))
    assert bool(all_finite(tensors[1:]))
    assert all(bool((flat == 0).all()) for _, flat in reduced_buckets(tensors, 0.0, lambda x: None))
