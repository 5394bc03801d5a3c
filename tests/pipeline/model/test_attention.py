"""Attention backends (pipeline/model/attention.py) against the reference: SDPA with a dense document mask.

On CPU, FlexAttention runs forward only; varlen needs CUDA. The CUDA tests
(forward and gradients of every backend, bf16) are skipped without a GPU."""

import pytest
import torch
import torch.nn.functional as F

from pipeline.model import attention
from pipeline.model.attention import AttentionBackendError, Flex, SDPA, Varlen, document_mask, resolve, use_backend
from pipeline.model.transformer import Transformer, build_config

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
T = 256  # two of FlexAttention's 128-position blocks, so documents cross block boundaries


def segments(layout: str, B: int = 2, device: str = "cpu") -> torch.Tensor:
    """(B, T) segment ids: one document per row, two, or many of uneven lengths."""
    if layout == "one":
        return torch.zeros(B, T, dtype=torch.long, device=device)
    if layout == "two":
        return (torch.arange(T) >= 100).long().expand(B, T).contiguous().to(device)
    g = torch.Generator().manual_seed(0)
    starts = torch.rand(B, T, generator=g) < 0.05  # ~13 documents per row, lengths 1..
    starts[:, 0] = False
    return torch.cumsum(starts.long(), 1).to(device)


def qkv(B=2, n_head=4, n_kv_head=2, hd=16, dtype=torch.float32, device="cpu", grad=False):
    g = torch.Generator().manual_seed(1)
    shapes = [(B, n_head, T, hd), (B, n_kv_head, T, hd), (B, n_kv_head, T, hd)]
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_(grad) for s in shapes]


def reference(q, k, v, seg):
    """Dense-mask SDPA in fp32 with the key/value heads copied: the definition."""
    n_rep = q.size(1) // k.size(1)
    k, v = k.float().repeat_interleave(n_rep, 1), v.float().repeat_interleave(n_rep, 1)
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=document_mask(seg))


@pytest.mark.parametrize("layout", ["one", "two", "many"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_flex_forward_matches_dense_sdpa_on_cpu(layout, heads):
    q, k, v = qkv(n_head=heads[0], n_kv_head=heads[1])
    seg = segments(layout)
    flex = Flex()
    y = flex.attend(q, k, v, flex.document_mask(seg))
    torch.testing.assert_close(y, reference(q, k, v, seg), rtol=1e-5, atol=1e-5)


def test_flex_block_mask_skips_blocks_across_documents():
    """Two documents of 128: the block of queries in the second sees no key block of the first."""
    seg = (torch.arange(T) >= 128).long()[None]
    dense = Flex().document_mask(seg).to_dense()  # (1, 1, 2, 2) blocks that hold any unmasked pair
    assert dense[0, 0].tolist() == [[1, 0], [0, 1]]


def test_compiled_flex_builds_its_block_mask_compiled_too():
    """Eager, create_block_mask evaluates the mask on every (row, query, key) at
    once: 735 MB of transient memory at 4 rows of 4096 on a CPU, per forward. The
    compiled backend (CUDA's) builds it compiled, with the same blocks."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    seg = segments("many")
    compiled = Flex(compile=True).document_mask(seg)
    assert counters["stats"]["unique_graphs"] >= 1
    assert torch.equal(compiled.to_dense(), Flex().document_mask(seg).to_dense())
    torch._dynamo.reset()


def test_whole_model_with_flex_matches_sdpa_on_cpu():
    torch.manual_seed(0)
    model = Transformer(build_config("tiny", 97, max_seq_len=T)).eval()
    idx = torch.randint(0, 97, (2, T))
    seg = segments("many")
    with torch.no_grad():
        ref = model(idx, segment_ids=seg)
        use_backend(model, Flex())
        got = model(idx, segment_ids=seg)
        plain = model(idx)  # no segment ids: every backend runs causal SDPA
        use_backend(model, SDPA())
        plain_ref = model(idx)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(plain, plain_ref)


def test_cpu_sdpa_keeps_copied_heads_bit_for_bit():
    """enable_gqa gives other key/value gradients on CPU; the default run must not change."""
    seg = segments("many")
    for mask in (document_mask(seg), None):
        q, k, v = qkv(grad=True)
        y = attention.sdpa(q, k, v, mask)
        grads = torch.autograd.grad((y * y).sum(), (q, k, v))
        q2, k2, v2 = qkv(grad=True)
        y2 = F.scaled_dot_product_attention(q2, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1),
                                            attn_mask=mask, is_causal=mask is None)
        grads2 = torch.autograd.grad((y2 * y2).sum(), (q2, k2, v2))
        assert torch.equal(y, y2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_varlen_sequence_lengths_cover_every_document_of_every_row():
    seg = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    cu, longest = Varlen.document_mask(Varlen.__new__(Varlen), seg)
    assert cu.tolist() == [0, 2, 5, 6, 12] and cu.dtype == torch.int32 and longest == 6


def test_varlen_documents_are_runs_of_one_id_whatever_the_ids_order():
    """A document is a run of equal segment ids, as the dense mask sees it: ids
    need not grow along a row (a row of ids 3, 3, 1, 1, 2 holds three documents)."""
    seg = torch.tensor([[3, 3, 1, 1, 2], [0, 0, 0, 5, 5]])
    cu, longest = Varlen.document_mask(Varlen.__new__(Varlen), seg)
    assert cu.tolist() == [0, 2, 4, 5, 8, 10] and longest == 3


def _flash_by_document(query, key, value, cu, causal, gqa):
    """What varlen_attn computes, on the CPU: causal SDPA over each document of the flattened batch."""
    assert causal and cu.dtype == torch.int32 and (gqa or key.size(1) == query.size(1))
    out = torch.empty_like(query)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        q, k, v = (t[s:e].transpose(0, 1) for t in (query, key, value))  # (heads, length, hd)
        out[s:e] = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                  enable_gqa=gqa)[0].transpose(0, 1)
    return out


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None,
                scale=None):
    return _flash_by_document(query, key, value, cu_seq_q, is_causal, False)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    return _flash_by_document(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), False)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    return _flash_by_document(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), enable_gqa)


@pytest.mark.parametrize("kernel", [varlen_2_10, varlen_2_11, varlen_2_13])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_varlen_packs_the_documents_for_the_varlen_attn_of_each_torch_release(monkeypatch, kernel, heads):
    """The flash kernel is CUDA-only; a CPU stand-in with each release's keywords
    (2.10: is_causal; 2.11: window_size; 2.13: window_size and enable_gqa) checks
    the call and the packing of every document of every row against the reference."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", kernel)
    q, k, v = qkv(n_head=heads[0], n_kv_head=heads[1])
    seg = segments("many")
    backend = Varlen()
    y = backend.attend(q, k, v, backend.document_mask(seg))
    torch.testing.assert_close(y, reference(q, k, v, seg), rtol=1e-5, atol=1e-5)


def test_resolve_picks_sdpa_on_cpu_and_refuses_what_cannot_run():
    cpu = torch.device("cpu")
    assert resolve("auto", cpu, "bf16").name == "sdpa"
    assert resolve("flex", cpu, training=False).name == "flex"
    for name, words in [("varlen", "needs a CUDA device"), ("flex", "trains on CUDA only"),
                        ("flash", "choose one of: auto, sdpa, flex, varlen")]:
        with pytest.raises(AttentionBackendError, match=words) as err:
            resolve(name, cpu, "bf16")
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("capability, auto", [((9, 0), "varlen"), ((8, 0), "varlen"), ((7, 5), "flex")])
def test_auto_picks_varlen_only_on_a_gpu_that_runs_flash_attention(monkeypatch, capability, auto):
    """Flash attention needs compute capability 8.0: a T4 (7.5) in fp16 trains with flex,
    and varlen asked for there is refused in one line, not at the first forward."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "Flex", lambda compile: SDPA())  # no CUDA kernels to compile here
    monkeypatch.setattr(attention, "Varlen", lambda: Varlen.__new__(Varlen))
    dev = torch.device("cuda", 0)
    got = resolve("auto", dev, "fp16")
    assert got.name == ("sdpa" if auto == "flex" else auto)  # the Flex stand-in is an SDPA
    if auto == "flex":
        with pytest.raises(AttentionBackendError, match=r"compute capability 8.0 .* cuda:0 is 7.5; use flex$"):
            resolve("varlen", dev, "fp16")
    else:
        assert resolve("varlen", dev, "bf16").name == "varlen"


def test_varlen_runs_in_half_precision_only_and_auto_takes_flex_in_fp32(monkeypatch):
    """Flash attention has no fp32 kernel: auto in fp32 on an Ampere GPU is flex,
    and varlen asked for in fp32 is refused in one line."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "Flex", lambda compile: SDPA())  # no CUDA kernels to compile here
    monkeypatch.setattr(attention, "Varlen", lambda: Varlen.__new__(Varlen))
    dev = torch.device("cuda", 0)
    assert resolve("auto", dev, "fp32").name == "sdpa"  # the Flex stand-in
    with pytest.raises(AttentionBackendError, match="runs in bf16 or fp16 .*, not fp32; set compute.precision"):
        resolve("varlen", dev, "fp32")


def test_use_backend_makes_the_model_build_the_mask_its_layers_read():
    """The model builds the mask once with the backend and every layer attends
    with it: a backend whose masks the SDPA default could not read sees its own."""

    class Wrapped(SDPA):
        def document_mask(self, segment_ids):
            return ("wrapped", document_mask(segment_ids))

        def attend(self, q, k, v, mask):
            assert mask[0] == "wrapped"
            return super().attend(q, k, v, mask[1])

    torch.manual_seed(0)
    model = Transformer(build_config("tiny", 64)).eval()
    idx, seg = torch.randint(0, 64, (2, 32)), segments("many")[:, :32]
    expected = model(idx, segment_ids=seg)
    use_backend(model, Wrapped())
    assert torch.equal(model(idx, segment_ids=seg), expected)


def test_trainer_config_carries_the_backend_outside_the_identity():
    from pipeline.training.config import ComputeSection, TrainConfig, identity_sections

    assert ComputeSection().attention == "auto" and not ComputeSection.identity
    with pytest.raises(ValueError, match="attention"):
        ComputeSection(attention="flash")
    cfg = TrainConfig(compute={"attention": "flex"})
    assert identity_sections(cfg) == identity_sections(TrainConfig())


# ---------------------------------------------------------------- CUDA: every backend, forward and gradients


@needs_cuda
@pytest.mark.parametrize("name", ["sdpa", "flex", "varlen"])
@pytest.mark.parametrize("layout", ["one", "two", "many"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_cuda_backend_forward_and_gradients_match_reference(name, layout, heads):
    dev = torch.device("cuda")
    backend = resolve(name, dev, "bf16")
    seg = segments(layout, device="cuda")
    q, k, v = qkv(n_head=heads[0], n_kv_head=heads[1], hd=64, dtype=torch.bfloat16, device="cuda", grad=True)
    y = backend.attend(q, k, v, backend.document_mask(seg))
    ref = reference(q, k, v, seg)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    w = torch.randn_like(ref)
    got = torch.autograd.grad((y.float() * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


@needs_cuda
def test_cuda_auto_picks_a_document_masking_kernel():
    dev = torch.device("cuda")
    assert resolve("auto", dev, "bf16").name in ("varlen", "flex")
    assert resolve("auto", dev, "fp32").name == "flex"
    with pytest.raises(AttentionBackendError, match="bf16 or fp16"):
        resolve("varlen", dev, "fp32")


@pytest.mark.parametrize("mask", ["none", "dense"])
def test_varlen_without_segment_ids_computes_with_sdpa(monkeypatch, mask):
    """data.doc_mask false (mask None: plain causal) and the KV cache (a dense
    causal mask) pass no cu_seqlens; varlen runs them as SDPA does."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_2_13)
    q, k, v = qkv()
    m = None if mask == "none" else document_mask(segments("many"))
    assert torch.equal(Varlen().attend(q, k, v, m), attention.sdpa(q, k, v, m))


def test_a_torch_without_varlen_attn_trains_with_flex_and_refuses_varlen_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "Flex", lambda compile: type("Flex", (SDPA,), {"name": "flex"})())
    monkeypatch.setattr(attention, "_has_varlen", lambda: False)
    dev = torch.device("cuda", 0)
    assert resolve("auto", dev, "bf16").name == "flex"
    with pytest.raises(AttentionBackendError, match=r"has no torch.nn.attention.varlen.varlen_attn; use flex$") as err:
        resolve("varlen", dev, "bf16")
    assert "\n" not in str(err.value)


def test_flex_in_bf16_on_a_gpu_before_ampere_is_refused_in_one_line(monkeypatch):
    """Triton has no bf16 before compute capability 8.0 ("Feature '.bf16' requires
    .target sm_80"): compute.precision bf16 on a T4 with flex (auto's choice there)
    would fail at the first forward; it is refused when the backend is resolved,
    which the launcher does before any rank starts. fp16 and fp32 keep flex, and
    sdpa (eager, bf16 emulated) stays allowed."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "Flex", lambda compile: type("Flex", (SDPA,), {"name": "flex"})())
    dev = torch.device("cuda", 0)
    for name in ("flex", "auto"):
        with pytest.raises(AttentionBackendError, match=r"cuda:0 is 7\.5; set compute.precision to fp16") as err:
            resolve(name, dev, "bf16")
        assert "\n" not in str(err.value) and str(err.value).startswith(f"attention {name}")
    assert [resolve(name, dev, p).name for name in ("flex", "auto") for p in ("fp16", "fp32")] == ["flex"] * 4
    assert resolve("sdpa", dev, "bf16").name == "sdpa"
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: Triton's AMD backend has bf16
    assert resolve("flex", dev, "bf16").name == "flex"
