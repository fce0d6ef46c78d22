"""Pseudo-gradient codecs, one object each: round trips against hand-computed values (pure, one process)."""

import pytest
import torch

from lightning_hdet._checks import ArgumentNameError
from lightning_hdet.asynchronous.wire.codecs import (
    BF16,
    CODEC_PRESETS,
    ErrorFeedback,
    Int8,
    NoCodec,
    TopK,
    check_codecs,
    codec_from,
    codec_numbers,
    row_layout,
)

SHAPES = [torch.Size([2, 4]), torch.Size([3])]  # a weight (2 rows of 4) and a bias (flat)


def test_row_layout_rows_of_matrices_and_chunks_of_flat_tensors():
    shapes = [torch.Size([2, 4]), torch.Size([5]), torch.Size([0]), torch.Size([]), torch.Size([3, 1, 2])]
    assert row_layout(shapes, chunk=2) == [(0, 2, 4), (8, 2, 2), (12, 1, 1), (13, 1, 1), (14, 3, 2)]


def test_none_is_the_float32_bytes_without_a_copy():
    codec = NoCodec().bind(SHAPES)
    flat = torch.arange(11.0) - 5.5
    message = codec.encode(flat)
    assert codec.nbytes == message.numel() == 44 and message.data_ptr() == flat.data_ptr()
    assert torch.equal(codec.decode(message), flat)


def test_bf16_is_exact_for_representable_values_and_rounds_to_nearest_even():
    codec = BF16().bind(SHAPES)
    exact = torch.tensor([1.0, -0.5, 3.0, 0.15625, -1024.0, 0.0, 2.0**-20, 7.5, -96.0, 1.0 / 64, 0.75])
    assert codec.nbytes == 22
    assert torch.equal(codec.decode(codec.encode(exact)), exact)
    # bfloat16 has 7 mantissa bits: 1 + 2^-9 is below half an ulp (2^-8) of 1; 1 + 3 * 2^-9 is above it
    inexact = torch.tensor([1 + 2.0**-9, 1 + 3 * 2.0**-9] + [0.0] * 9)
    assert codec.decode(codec.encode(inexact))[:2].tolist() == [1.0, 1 + 2.0**-7]


def test_int8_row_scales_hand_computed():
    codec = Int8(chunk=2).bind(SHAPES)
    # segments: weight rows (0, 2, 4); bias chunks (8, 1, 2) and (10, 1, 1) -> 4 scales
    assert len(codec.segments) == 3 and codec.nbytes == 4 * 4 + 11
    flat = torch.tensor([1.0, -0.5, 0.25, 0.0,  # absmax 1: q = 127, -63.5 -> -64 (half to even), 31.75 -> 32, 0
                         0.0, 0.0, 0.0, 0.0,  # an all-zero row: scale 0, values 0
                         -2.0, 0.5,  # absmax 2: q = -127, 31.75 -> 32
                         3.0])  # a chunk of one: q = 127
    message = codec.encode(flat)
    scales, values = message[:16].view(torch.float32), message[16:].view(torch.int8)
    torch.testing.assert_close(scales, torch.tensor([1 / 127, 0.0, 2 / 127, 3 / 127]))
    assert values.tolist() == [127, -64, 32, 0, 0, 0, 0, 0, -127, 32, 127]
    expected = torch.tensor([1.0, -64 / 127, 32 / 127, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0, 64 / 127, 3.0])
    torch.testing.assert_close(codec.decode(message), expected)


def test_int8_error_is_at_most_half_a_scale_per_row():
    torch.manual_seed(0)
    shapes = [torch.Size([16, 33]), torch.Size([700]), torch.Size([4, 2, 3])]
    codec = Int8(chunk=256).bind(shapes)
    flat = torch.cat([torch.randn(16 * 33) * torch.logspace(-3, 2, 16).repeat_interleave(33),
                      torch.randn(700), torch.randn(24) * 1e-6])
    decoded = codec.decode(codec.encode(flat))
    for offset, rows, length in codec.segments:
        block = flat[offset: offset + rows * length].view(rows, length)
        error = (decoded[offset: offset + rows * length].view(rows, length) - block).abs()
        bound = block.abs().amax(dim=1, keepdim=True) / 254
        assert (error <= bound * (1 + 1e-5)).all()
    assert codec.nbytes == 4 * (16 + 3 + 4) + flat.numel()  # 700 values: chunks of 256, 256, 188


def test_error_feedback_carries_the_rounding_to_the_next_push():
    codec = BF16().bind([torch.Size([1])])
    feedback, plain = ErrorFeedback(codec), ErrorFeedback(codec, enabled=False)
    g = 1 + 2.0**-9
    sent = []
    for _ in range(3):
        sent.append(codec.decode(feedback.encode(torch.tensor([g]))).item())
    # push 1: 1 + 2^-9 -> 1, residual 2^-9; push 2: 1 + 2^-8 is a tie -> 1 (even), residual 2^-8;
    # push 3: 1 + 3 * 2^-9 -> 1 + 2^-7, residual -2^-9
    assert sent == [1.0, 1.0, 1 + 2.0**-7]
    assert feedback.residual.tolist() == [-(2.0**-9)]
    assert [codec.decode(plain.encode(torch.tensor([g]))).item() for _ in range(3)] == [1.0] * 3
    assert plain.residual.numel() == 0


def test_error_feedback_decoded_pushes_sum_to_the_true_ones_minus_the_residual():
    torch.manual_seed(1)
    codec = Int8(chunk=2).bind(SHAPES)
    feedback = ErrorFeedback(codec)
    pushes = [torch.randn(11) for _ in range(5)]
    total = sum(codec.decode(feedback.encode(g.clone())) for g in pushes)
    torch.testing.assert_close(total + feedback.residual, sum(pushes))
    restored = ErrorFeedback(codec)
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.residual, feedback.residual)


def test_none_keeps_no_residual():
    feedback = ErrorFeedback(NoCodec().bind(SHAPES))
    flat = torch.ones(11)
    assert feedback.residual.numel() == 0 and torch.equal(feedback.codec.decode(feedback.encode(flat)), flat)


def test_wrong_sizes_and_arguments_are_named():
    codec = Int8().bind(SHAPES)
    with pytest.raises(ValueError, match="11 float32 values, got 10"):
        codec.encode(torch.zeros(10))
    with pytest.raises(ValueError, match=r"A Int8\(chunk=256\) message has"):
        codec.decode(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="`compression` must be one of .* Or a codec object"):
        codec_from("fp8")
    with pytest.raises(ValueError, match="`error_feedback` must be True or False"):
        check_codecs(BF16(), NoCodec(), 1)
    with pytest.raises(ValueError, match="`chunk` must be a positive integer"):
        Int8(chunk=0).bind(SHAPES)


def test_topk2_keeps_the_largest_values_of_each_chunk_in_two_bits_hand_computed():
    """One chunk of 128 values keeps 128 // 64 = 2: the two largest magnitudes, 3.0 at 5 and -1.0 at 70. Scale
    3.0 / 1.5 = 2; levels round(3 / 2 + 1.5) = 3 and round(-1 / 2 + 1.5) = 1 stand for (3 - 1.5) * 2 = 3.0 and
    (1 - 1.5) * 2 = -1.0. The message: 4 scale bytes + 2 x 2 position bytes + one byte of two 2-bit levels."""
    flat = torch.full((128,), 0.01)
    flat[5], flat[70] = 3.0, -1.0
    codec = TopK(bits=2).bind([torch.Size([128])])
    message = codec.encode(flat)
    assert codec.nbytes == message.numel() == 9
    assert message[:4].view(torch.float32).item() == 2.0
    assert sorted(message[4:8].view(torch.int16).tolist()) == [5, 70]
    expected = torch.zeros(128)
    expected[5], expected[70] = 3.0, -1.0
    assert torch.equal(codec.decode(message), expected)


def test_topk4_levels_and_a_last_short_chunk_hand_computed():
    """4 bits: 15 levels of scale absmax / 7.5. A 4096-value chunk (keeps 64) then a 70-value one (keeps 1): in the
    last, 7.5 is exact (level 15) and the only kept value; in the first, 2.0 of scale 1 takes level round(9.5) = 10
    (ties to even), decoded 2.5."""
    flat = torch.zeros(4096 + 70)
    flat[:64] = torch.linspace(2.0, 7.5, 64)  # the 64 kept values of chunk 0, largest 7.5: scale 1
    flat[4096 + 9] = 7.5
    codec = TopK(bits=4).bind([torch.Size([4096 + 70])])
    assert codec.nbytes == 2 * 4 + 65 * 2 + 33  # two scales, 65 positions, 65 levels two to a byte (one padded)
    decoded = codec.decode(codec.encode(flat))
    assert decoded[0] == 2.5 and decoded[63] == 7.5 and decoded[4096 + 9] == 7.5
    assert torch.count_nonzero(decoded) == 65 and torch.all((decoded[:64] - flat[:64]).abs() <= 0.5)


def test_sparse_pushes_with_error_feedback_send_everything_in_the_end():
    """The same pseudo-gradient pushed again and again through topk2 with error feedback: the decoded pushes always
    sum to the true ones minus the residual (nothing is lost, only delayed), and the residual stays bounded."""
    g = torch.randn(300, generator=torch.Generator().manual_seed(0))
    feedback = ErrorFeedback(TopK(bits=2).bind([torch.Size([300])]))
    total = torch.zeros(300)
    for n in range(1, 401):
        total += feedback.codec.decode(feedback.encode(g.clone()))
        torch.testing.assert_close(total + feedback.residual, n * g, rtol=1e-5, atol=1e-3)
    assert feedback.residual.abs().max() < 300 * g.abs().max()  # bounded: far below 400 pushes' worth
    torch.testing.assert_close(total / 400, g, rtol=0, atol=0.75 * g.abs().max().item())


def test_a_sparse_codec_needs_error_feedback():
    with pytest.raises(ValueError, match=r"`error_feedback` must be True with compression=TopK\(fraction=0.015625,"
                                         r" bits=2\), got False"):
        check_codecs(TopK(bits=2), NoCodec(), False)
    assert check_codecs(TopK(bits=4), NoCodec(), True)
    assert not check_codecs(NoCodec(), NoCodec(), None) and check_codecs(Int8(), NoCodec(), None)


def test_presets_are_objects_and_an_object_is_what_runs():
    """The strings are presets of the objects, in one table; an object or its options (what an elastic service
    publishes) come back as the same object."""
    assert codec_from("topk4") == TopK(fraction=1 / 64, bits=4) and codec_from("none") == NoCodec()
    assert set(CODEC_PRESETS) == {"none", "bf16", "int8", "topk2", "topk4"}
    mine = TopK(fraction=0.05, bits=4)
    assert codec_from(mine) is mine and codec_from(mine.options()) == mine
    assert codec_numbers("compression", mine) == {"compression": "TopK", "compression/fraction": 0.05,
                                                  "compression/bits": 4}
    assert repr(Int8(chunk=64)) == "Int8(chunk=64)"


def test_topk_fraction_sets_the_kept_values_per_chunk_hand_computed():
    """fraction 1/16 of a 128-value chunk keeps 8 values: 4 scale bytes, 8 int16 positions, 8 levels of 4 bits in 4
    bytes = 24 bytes; the 8 largest magnitudes come back exactly when they are the scale's levels (+-7.5 x 1)."""
    flat = torch.zeros(128)
    flat[:8] = torch.tensor([7.5, -7.5, 6.5, -6.5, 5.5, -5.5, 4.5, -4.5])
    codec = TopK(fraction=1 / 16, bits=4).bind([torch.Size([128])])
    assert codec.nbytes == 4 + 2 * 8 + 4
    assert torch.equal(codec.decode(codec.encode(flat)), flat)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: TopK(bits=3), r"`bits` must be one of \(1, 2, 4, 8\), got 3"),
    (lambda: TopK(fraction=0.0), r"`fraction` must be a number in \(0, 1\], got 0.0"),
    (lambda: Int8(chunk=-1), "`chunk` must be a positive integer, got -1"),
    # a bool is an int to Python, and 2.0 == 2: neither is a bit count
    (lambda: TopK(bits=True), r"`bits` must be one of \(1, 2, 4, 8\), got True"),
    (lambda: TopK(bits=2.0), r"`bits` must be one of \(1, 2, 4, 8\), got 2.0"),
    (lambda: TopK(fraction=True), r"`fraction` must be a number in \(0, 1\], got True"),
    (lambda: Int8(chunk=True), "`chunk` must be a positive integer, got True"),
])
def test_codec_options_are_checked_on_creation(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_a_misspelled_codec_option_names_the_closest() -> None:
    with pytest.raises(ArgumentNameError, match="TopK got an unsupported argument `bit`=2. Did you mean `bits`?"):
        TopK(bit=2)
