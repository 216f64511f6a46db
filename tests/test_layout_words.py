"""The Ulysses layouts' word copies (sp/ulysses/layout.py: copy_bits / index_copy_bits move 8-byte words on GPUs):
the word views exist exactly where they should, and copying words moves the same bytes as copying values (NaN
payloads and -0.0 included), for the head splits, the transposes and the piece permutations the layouts make. The
CUDA suite's test_layout_word_copies_bitwise compares the GPU's word copies with these functions' value copies on
CPU, bit for bit."""
import pytest
import torch

from megatron_sp_ext.sp.ulysses.layout import as_words, copy_bits, index_copy_bits


def _bf16_with_specials(*shape):
    x = torch.randn(*shape).to(torch.bfloat16)
    flat = x.view(-1).view(torch.int16)
    flat[:6] = torch.tensor([0x7FC1, 0x7F81, -1, 0x0001, -32768, 0x7F80], dtype=torch.int16)  # NaNs, -0.0, inf
    return x


@pytest.mark.parametrize("dtype,ratio", [(torch.bfloat16, 4), (torch.float16, 4), (torch.float32, 2)])
def test_word_views_where_they_exist(dtype, ratio):
    x = torch.zeros(2, 6, 8, 16, dtype=dtype)
    w = as_words(x.view(2, 6, 2, 4, 16)[:, :, 1].permute(1, 0, 2, 3))   # a head slice, transposed
    assert w is not None and w.dtype == torch.int64 and w.shape[-1] == 16 // ratio
    assert w.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert as_words(x.transpose(-1, -2)) is None                         # last dim not contiguous
    assert as_words(torch.zeros(3, 9, dtype=dtype)[:, 1:9]) is None         # storage offset 1: misaligned
    assert as_words(torch.zeros(3, 6, dtype=torch.bfloat16)) is None      # 6 values: not whole words
    assert as_words(torch.zeros(4, 8, dtype=torch.float64)) is None       # already 8 bytes
    assert as_words(torch.tensor(1.0)) is None


def test_words_move_the_same_bytes():
    x = _bf16_with_specials(1, 64, 6, 32)                    # [B, S_loc, H, D]
    src = x.view(1, 64, 2, 3, 32).permute(2, 1, 0, 3, 4)     # every peer's 3 heads: the pack's source view
    ref = torch.empty(2, 64, 1, 3, 32, dtype=torch.bfloat16)
    ref.copy_(src)
    got = torch.empty_like(ref)
    as_words(got).copy_(as_words(src))
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    # a piece permutation (the zigzag order) along a non-last dim
    idx = torch.tensor([2, 0, 3, 1])
    pieces = x.view(4, 16, 6, 32)
    ref2 = torch.empty_like(pieces).index_copy_(0, idx, pieces)
    got2 = torch.empty_like(pieces)
    as_words(got2).index_copy_(0, idx, as_words(pieces))
    assert torch.equal(got2.view(torch.int16), ref2.view(torch.int16))


def test_copy_bits_on_cpu_is_a_plain_copy():
    x = _bf16_with_specials(3, 5, 8)
    dst = torch.empty(5, 3, 8, dtype=torch.bfloat16)
    copy_bits(dst, x.transpose(0, 1))
    assert torch.equal(dst.view(torch.int16), x.transpose(0, 1).contiguous().view(torch.int16))
    half = torch.empty(5, 3, 8, dtype=torch.float32)
    copy_bits(half, x.transpose(0, 1))                       # a dtype change: values converted, as copy_ does
    assert torch.allclose(half, x.transpose(0, 1).float(), rtol=0, atol=0, equal_nan=True)
    out = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    index_copy_bits(out, 0, torch.tensor([3, 1]), x[:2, :2])
    bits = out.view(torch.int16)
    assert torch.equal(bits[3], x[0, :2].view(torch.int16)) and torch.equal(bits[1], x[1, :2].view(torch.int16))
    assert not bits[0].any() and not bits[2].any()


def test_word_pair_keeps_autograd_and_guards_edges(monkeypatch):
    """The word path is never taken for a differentiable copy (copy_ keeps the graph and torch's in-place check on a
    leaf), and a 0-dim index_copy stays torch's. The device check is what keeps CPU on value copies; here a fake
    device type lets the rest of the rule run on CPU tensors."""
    from megatron_sp_ext.sp.ulysses import layout as lay
    src = torch.randn(2, 8, requires_grad=True)
    dst = torch.zeros(2, 8)
    fake = type("Dev", (), {"type": "cuda"})()

    class T(torch.Tensor):
        @property
        def device(self):
            return fake
    assert lay._word_pair(dst.as_subclass(T), src.detach().as_subclass(T)) is not None
    assert lay._word_pair(dst.as_subclass(T), src.as_subclass(T)) is None          # grad wanted: value copy
    with torch.no_grad():
        assert lay._word_pair(dst.as_subclass(T), src.as_subclass(T)) is not None
    lay.copy_bits(dst, src)
    assert dst.grad_fn is not None                                                  # CopyBackwards kept
    z = torch.zeros(())
    lay.index_copy_bits(z, 0, torch.tensor([0]), torch.ones(()))
    assert z.item() == 1.0
