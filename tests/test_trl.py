"""linear_ce.integrations.trl against TRL's own fused LM head.

Three levels: TRL's kernel call (``ChunkedLogProbFunction.apply``) against the adapter and
against the float64 plain expression; a model given TRL's fused head
(``add_fused_lm_head``), patched and unpatched; and real TRL trainers (SFT, DPO, GRPO) on
a tiny random Llama and a word-level tokenizer built here (nothing is downloaded), where
losses, logged metrics and every parameter's gradient of the patched run equal the
unpatched run's, and a counter on TRL's kernel shows it is not called while patched.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'linear-ce[trl]'")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
)
from trl.kernels import chunked_logprob  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

from conftest import eps, rel_err  # noqa: E402
from linear_ce import LinearCrossEntropyOptions  # noqa: E402
from linear_ce.integrations import trl as lce_trl  # noqa: E402

F32 = eps(torch.float32)
ALL_OUTPUTS = ("log_probs", *lce_trl.TRL_OUTPUTS)
TRANSFORMS = {
    "plain": (1.0, None, 1.0),
    "temperature": (0.7, None, 1.0),
    "all": (1.3, 3.0, 0.8),  # temperature, softcap, logit_scale
}


@pytest.fixture(autouse=True)
def _unpatched():
    """Every test starts and ends with TRL's own head."""
    lce_trl.unpatch()
    yield
    lce_trl.unpatch()


def _kernel_inputs(seed: int, dtype=torch.float32, bias=True, rows=37, vocab=101, feat=16):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, feat, generator=g, dtype=torch.float64)
    W = torch.randn(vocab, feat, generator=g, dtype=torch.float64) / 2
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, vocab, (rows,), generator=g)
    up = torch.randn(2, rows, generator=g, dtype=torch.float64)
    leaves = [None if v is None else v.to(dtype).requires_grad_() for v in (h, W, b)]
    return leaves, t, up


def _plain(h, W, b, t, temperature, softcap, logit_scale):
    """The five outputs of TRL's kernel from the full logits (float64 reference)."""
    s = h @ W.T + (0 if b is None else b)
    s = s * logit_scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s / temperature
    logp = torch.log_softmax(s, -1)
    p = logp.exp()
    return (
        logp.gather(-1, t[:, None])[:, 0],
        -(p * logp).sum(-1),
        (p * p).sum(-1).log(),
        s.mean(-1),
        s.argmax(-1) == t,
    )


def _scaled_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Error of per-token values that are differences of O(1) terms (a mean logit near 0
    is still a few eps of the logits off): relative to at least 1 per token."""
    scale = max(torch.linalg.vector_norm(want.double()).item(), want.numel() ** 0.5)
    return torch.linalg.vector_norm(got.double() - want.double()).item() / scale


def _backward(outputs, leaves, up, flows):
    total = sum((outputs[i] * up[i].to(outputs[i].dtype)).sum() for i in flows)
    wanted = [v for v in leaves if v is not None]
    got = iter(torch.autograd.grad(total, wanted))
    return [None if v is None else next(got) for v in leaves]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("flows", [(0,), (1,), (0, 1)], ids=["logprob", "entropy", "both"])
def test_kernel_call_matches_trl_and_float64(transform, bias, flows):
    """Same arguments as TRL's kernel: the five outputs (values, dtypes, which are
    differentiable) and the gradients from log_probs and entropy."""
    temperature, softcap, scale = TRANSFORMS[transform]
    leaves, t, up = _kernel_inputs(1, bias=bias)
    args = (t, temperature, 32, softcap, scale, ALL_OUTPUTS)
    ours = lce_trl.TokenLogprobsFunction.apply(*leaves, *args, None)
    theirs = chunked_logprob.ChunkedLogProbFunction.apply(*leaves, *args)
    ref_leaves = [None if v is None else v.detach().double().requires_grad_() for v in leaves]
    ref = _plain(*ref_leaves, t, temperature, softcap, scale)
    for got, trl_out, want in zip(ours, theirs, ref, strict=True):
        assert got.dtype == trl_out.dtype and got.requires_grad == trl_out.requires_grad
        if want.dtype == torch.bool:
            assert torch.equal(got, want) and torch.equal(trl_out, want)
            continue
        for value in (got, trl_out):
            assert _scaled_err(value, want) <= 8 * F32
    got = _backward(ours, leaves, up, flows)
    trl_grads = _backward(theirs, leaves, up, flows)
    want = _backward(ref, ref_leaves, up, flows)
    for g, tg, w in zip(got, trl_grads, want, strict=True):
        if w is not None:
            assert g.dtype == tg.dtype
            assert rel_err(g, w) <= max(4 * F32, 2 * rel_err(tg, w))


def test_outputs_not_asked_for_are_none():
    leaves, t, _ = _kernel_inputs(2)
    for outputs in [("log_probs",), ("log_probs", "entropy"), ("log_probs", "mean_logits")]:
        args = (t, 1.0, 32, None, 1.0, outputs)
        ours = lce_trl.TokenLogprobsFunction.apply(*leaves, *args, None)
        theirs = chunked_logprob.ChunkedLogProbFunction.apply(*leaves, *args)
        assert [v is None for v in ours] == [v is None for v in theirs]


def test_is_top1_counts_ties_as_torch_argmax_does():
    """TRL's is_top1 is ``argmax == target`` with the first-index rule; with exact integer
    logits, every kind of tie."""
    W = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    h = torch.tensor([[1.0, 0.0]] * 3 + [[0.0, 3.0]] * 3)
    t = torch.tensor([0, 1, 2, 2, 3, 0])
    args = (t, 1.0, 32, None, 1.0, ALL_OUTPUTS)
    ours = lce_trl.TokenLogprobsFunction.apply(h, W, None, *args, None)[4]
    theirs = chunked_logprob.ChunkedLogProbFunction.apply(h, W, None, *args)[4]
    expected = (h @ W.T).argmax(-1) == t
    assert ours.tolist() == theirs.tolist() == expected.tolist() == [1, 0, 0, 1, 0, 0]


@pytest.mark.parametrize(
    ("hidden_dtype", "weight_dtype", "expected"),
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float64, torch.float64, torch.float64),
    ],
)
def test_autocast_runs_the_head_in_the_wider_of_autocast_and_weight_dtype(
    monkeypatch, hidden_dtype, weight_dtype, expected
):
    """Under bf16 autocast the head gets the hidden states and the weight in the wider of
    the autocast dtype and the weight's (issue 29 item 14): fp32 parameters stay fp32,
    a bf16 weight gives a bf16 head as TRL's; the gradients come back in each leaf's dtype."""
    seen = []
    real = lce_trl.token_logprobs_and_stats

    def spy(hidden, weight, *args, **kwargs):
        seen.append((hidden.dtype, weight.dtype))
        return real(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(lce_trl, "token_logprobs_and_stats", spy)
    (h, W, _), t, up = _kernel_inputs(4, bias=False)
    h = h.detach().to(hidden_dtype).requires_grad_()
    W = W.detach().to(weight_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lce_trl.TokenLogprobsFunction.apply(h, W, None, t, 1.0, 32, None, 1.0, (), None)
    grads = _backward(out, [h, W], up, (0,))
    assert seen == [(expected, expected)]
    assert [g.dtype for g in grads] == [hidden_dtype, weight_dtype]


def test_fp32_parameters_under_autocast_get_the_fp32_head():
    """fp32 leaves under bf16 autocast (TRL's default config): every output and gradient is
    bitwise the one of the same call without autocast, so within fp32 rounding of float64
    on the unrounded inputs, where TRL's kernel, which rounds operands and logits to bf16,
    is ~1e-3 off."""
    leaves, t, up = _kernel_inputs(3, rows=64, vocab=300, feat=32)
    args = (t, 0.9, 128, None, 1.0, ALL_OUTPUTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = lce_trl.TokenLogprobsFunction.apply(*leaves, *args, None)
        theirs = chunked_logprob.ChunkedLogProbFunction.apply(*leaves, *args)
    plain = lce_trl.TokenLogprobsFunction.apply(*leaves, *args, None)
    for got, without in zip(ours, plain, strict=True):
        assert torch.equal(got, without)
    got = _backward(ours, leaves, up, (0, 1))
    for g, without in zip(got, _backward(plain, leaves, up, (0, 1)), strict=True):
        assert torch.equal(g, without)
    trl_grads = _backward(theirs, leaves, up, (0, 1))
    ref_leaves = [v.detach().double().requires_grad_() for v in leaves]
    want = _backward(_plain(*ref_leaves, t, 0.9, None, 1.0), ref_leaves, up, (0, 1))
    fp32_leaves = [v.detach().requires_grad_() for v in leaves]
    own = _backward(_plain(*fp32_leaves, t, 0.9, None, 1.0), fp32_leaves, up, (0, 1))
    for g, tg, w, o in zip(got, trl_grads, want, own, strict=True):
        assert g.dtype == tg.dtype == torch.float32
        # Twice the plain fp32 expression's own error (house rule), with the 4 eps floor
        # of test_kernel_call_matches_trl_and_float64; TRL's bf16 head is far above it.
        assert rel_err(g, w) <= max(4 * F32, 2 * rel_err(o, w)) < rel_err(tg, w)


def test_bf16_parameters_under_autocast_within_twice_trls_error():
    """bf16 leaves under autocast: both heads compute in bf16 and return fp32 outputs; each
    output and gradient is within 2x TRL's own error against float64 on the same inputs."""
    leaves, t, up = _kernel_inputs(3, dtype=torch.bfloat16, rows=64, vocab=300, feat=32)
    args = (t, 0.9, 128, None, 1.0, ALL_OUTPUTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = lce_trl.TokenLogprobsFunction.apply(*leaves, *args, None)
        theirs = chunked_logprob.ChunkedLogProbFunction.apply(*leaves, *args)
    ref_leaves = [v.detach().double().requires_grad_() for v in leaves]
    ref = _plain(*ref_leaves, t, 0.9, None, 1.0)
    for got, trl_out, want in zip(ours[:4], theirs[:4], ref[:4], strict=True):
        assert got.dtype == trl_out.dtype == torch.float32
        assert rel_err(got, want) <= max(4 * F32, 2 * rel_err(trl_out, want))
    up = up.to(torch.bfloat16).double()  # upstream gradients representable in both heads
    got = _backward(ours, leaves, up, (0, 1))
    trl_grads = _backward(theirs, leaves, up, (0, 1))
    want = _backward(ref, ref_leaves, up, (0, 1))
    for g, tg, w in zip(got, trl_grads, want, strict=True):
        assert g.dtype == tg.dtype == torch.bfloat16
        assert rel_err(g, w) <= max(3 * eps(torch.bfloat16), 2 * rel_err(tg, w))


# --- a model given TRL's fused head --------------------------------------------------

VOCAB = 61


def _llama(seed: int = 0, **config) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
            **config,
        )
    )


def _gemma2(seed: int = 0) -> Gemma2ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=3.0,
        sliding_window=4,
    )
    return Gemma2ForCausalLM(config)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (3, 11), generator=g)
    labels = ids.clone()
    labels[0, 7:] = -100
    labels[1, :4] = -100
    return ids, labels


def _fused_step(model, ids, labels, **call):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, fused_lm_head=True, **call)
    (out.loss + 0.1 * out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same_step(a, b, bound):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert rel_err(out_b.loss, out_a.loss) <= bound
    for field in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert _scaled_err(getattr(out_b, field), getattr(out_a, field)) <= bound, field
    assert torch.equal(out_b.is_top1, out_a.is_top1)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert rel_err(grads_b[name], grads_a[name]) <= bound, name


@pytest.mark.parametrize(
    ("build", "head"),
    [
        (_llama, {"temperature": 0.7}),
        (_gemma2, {}),  # final_logit_softcapping
        (functools.partial(_llama, tie_word_embeddings=True), {}),
    ],
    ids=["llama-temperature", "gemma2-softcap", "llama-tied"],
)
def test_fused_head_patched_equals_unpatched(build, head):
    """Every field of TRL's ``FusedCausalLMOutput`` and every parameter's gradient (from the
    loss and an entropy term) within fp32 rounding; ignored labels stay zero."""
    model = build()
    trl_utils.add_fused_lm_head(model, outputs=ALL_OUTPUTS, **head)
    ids, labels = _batch()
    expected = _fused_step(model, ids, labels)
    lce_trl.patch()
    got = _fused_step(model, ids, labels)
    _assert_same_step(expected, got, 16 * F32)
    ignored = labels[:, 1:] == -100
    assert not got[0].log_probs[ignored].any() and not got[0].entropy[ignored].any()


def test_all_ignored_micro_batch_is_a_differentiable_zero():
    model = _llama()
    trl_utils.add_fused_lm_head(model, outputs=ALL_OUTPUTS)
    ids = _batch()[0]
    with lce_trl.patched():
        out = model(input_ids=ids, labels=torch.full_like(ids, -100), fused_lm_head=True)
        out.loss.backward()
    assert out.loss.item() == 0.0 and not out.log_probs.any() and not out.is_top1.any()
    assert not model.lm_head.weight.grad.any()


def test_fp32_head_of_a_bf16_model():
    """``cast_lm_head_to_fp32``: the head runs in fp32 on a bf16 model, patched and not;
    the bf16 gradients agree but for rounding to bf16 of nearly equal values."""
    model = _llama().to(torch.bfloat16)
    trl_utils.add_fused_lm_head(model, cast_lm_head_to_fp32=True, outputs=ALL_OUTPUTS)
    ids, labels = _batch(1)
    expected = _fused_step(model, ids, labels)
    with lce_trl.patched():
        got = _fused_step(model, ids, labels)
    assert got[0].log_probs.dtype == expected[0].log_probs.dtype == torch.float32
    assert rel_err(got[0].loss, expected[0].loss) <= 16 * F32
    assert rel_err(got[0].log_probs, expected[0].log_probs) <= 16 * F32
    for name, grad in expected[1].items():
        assert grad.dtype == got[1][name].dtype == torch.bfloat16
        assert rel_err(got[1][name], grad) <= eps(torch.bfloat16), name


class _ZeRO3LikeGather:
    """Stands in for ``maybe_gather_lm_head_ctx`` under ZeRO-3: the head's weight holds NaN
    except inside the context, which records each entry."""

    def __init__(self, weight: torch.nn.Parameter):
        self.weight, self.full, self.entries = weight, weight.detach().clone(), 0
        # ZeRO-3 swaps the parameter's data (no in-place write, no version bump).
        weight.data = torch.full_like(self.full, math.nan)

    def __call__(self, *params):
        assert params[0] is self.weight
        return self._gathered()

    @contextlib.contextmanager
    def _gathered(self):
        self.entries += 1
        self.weight.data = self.full
        try:
            yield
        finally:
            self.weight.data = torch.full_like(self.full, math.nan)


def test_backward_gathers_the_head_again(monkeypatch):
    """ZeRO-3: TRL gathers the weight around the forward call; the patched backward, which
    recomputes the logits, enters TRL's gather context again, as TRL's own backward does."""
    ids, labels = _batch(2)
    results = []
    for patched in (False, True):
        model = _llama()
        trl_utils.add_fused_lm_head(model, outputs=ALL_OUTPUTS)
        gather = _ZeRO3LikeGather(model.lm_head.weight)
        monkeypatch.setattr(trl_utils, "maybe_gather_lm_head_ctx", gather)
        with lce_trl.patched() if patched else contextlib.nullcontext():
            results.append(_fused_step(model, ids, labels))
        assert gather.entries == 2  # forward and backward
    for name, grad in results[1][1].items():
        assert torch.isfinite(grad).all(), name
    _assert_same_step(*results, 16 * F32)


# --- patch, unpatch and the version check ----------------------------------------------


def test_patch_unpatch_and_context_manager():
    original = trl_utils._ChunkedLogProbFunction
    options = LinearCrossEntropyOptions(batch_chunk_size=4)
    assert not lce_trl.is_patched()
    lce_trl.patch()
    lce_trl.patch()  # again: still one patch, and unpatch restores TRL's kernel
    assert lce_trl.is_patched() and trl_utils._ChunkedLogProbFunction is not original
    with lce_trl.patched(options):
        assert trl_utils._ChunkedLogProbFunction.options is options
    assert lce_trl.is_patched() and trl_utils._ChunkedLogProbFunction.options is None
    lce_trl.unpatch()
    assert not lce_trl.is_patched() and trl_utils._ChunkedLogProbFunction is original
    with lce_trl.patched():
        assert lce_trl.is_patched()
    assert trl_utils._ChunkedLogProbFunction is original
    assert trl_utils._use_triton is chunked_logprob._use_triton


def _other_forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, outputs):
    """A ``ChunkedLogProbFunction.forward`` of another signature."""


def _fused_head_reading_nothing(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=()):
    """An ``add_fused_lm_head`` whose forward does not read the names the patch replaces."""

    def forward(*args):
        return args

    return forward


@pytest.mark.parametrize(
    ("target", "name", "value", "message"),
    [
        (chunked_logprob.ChunkedLogProbFunction, "forward", staticmethod(_other_forward), "takes"),
        (chunked_logprob, "OPTIONAL_OUTPUTS", ("entropy",), "OPTIONAL_OUTPUTS"),
        (trl_utils, "add_fused_lm_head", _fused_head_reading_nothing, "no longer reads"),
        (trl_utils, "_ChunkedLogProbFunction", object(), "is not"),
        (trl_utils, "maybe_gather_lm_head_ctx", lambda weight: None, r"\(\*params\)"),
    ],
    ids=["kernel-signature", "outputs", "call-site", "kernel-name", "gather"],
)
def test_other_trl_is_refused(monkeypatch, target, name, value, message):
    monkeypatch.setattr(target, name, value)
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(lce_trl.UnsupportedTRLVersion, match=message) as error:
        lce_trl.patch()
    assert "trl>=1.16,<1.17" in str(error.value) and "1.17.0" in str(error.value)
    assert not lce_trl.is_patched()


def test_without_trl_patch_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    with pytest.raises(ImportError, match=r"pip install 'linear-ce\[trl\]'"):
        lce_trl.patch()


@pytest.mark.parametrize("entry", ["patch", "patched"])
@pytest.mark.parametrize("options", ["fast", {"batch_chunk_size": 4}, 4])
def test_bad_options_are_refused_at_patch(entry, options):
    """``patch("fast")`` was accepted and failed at the first forward."""
    original = trl_utils._ChunkedLogProbFunction
    with pytest.raises(
        TypeError,
        match=rf"^linear_ce\.integrations\.trl\.{entry}: options must be a "
        r"linear_ce\.LinearCrossEntropyOptions or None, got",
    ):
        if entry == "patch":
            lce_trl.patch(options)
        else:
            with lce_trl.patched(options):
                pass
    assert not lce_trl.is_patched() and trl_utils._ChunkedLogProbFunction is original


def test_blocks_exiting_out_of_order_restore_the_state_before_the_first():
    """Overlapping blocks: the first one entered exits first. Each block used to restore
    what it saw on entry, so the first left TRL unpatched under the still-open second,
    and the second then patched it again for good."""
    original = trl_utils._ChunkedLogProbFunction
    first_options = LinearCrossEntropyOptions(batch_chunk_size=4)
    second_options = LinearCrossEntropyOptions(batch_chunk_size=8)
    for base in (None, LinearCrossEntropyOptions(batch_chunk_size=2)):
        if base is not None:
            lce_trl.patch(base)
        first, second = lce_trl.patched(first_options), lce_trl.patched(second_options)
        first.__enter__()
        assert trl_utils._ChunkedLogProbFunction.options is first_options
        second.__enter__()
        assert trl_utils._ChunkedLogProbFunction.options is second_options
        first.__exit__(None, None, None)
        assert lce_trl.is_patched()
        assert trl_utils._ChunkedLogProbFunction.options is second_options
        second.__exit__(None, None, None)
        if base is None:
            assert not lce_trl.is_patched() and trl_utils._ChunkedLogProbFunction is original
        else:
            assert trl_utils._ChunkedLogProbFunction.options is base
            lce_trl.unpatch()
    assert trl_utils._ChunkedLogProbFunction is original
    assert trl_utils._use_triton is chunked_logprob._use_triton


def test_blocks_in_threads_keep_trl_patched_until_the_last_exits():
    """Four threads enter their blocks in turn and leave them in the same order; each
    checks, just before leaving, that TRL is still patched."""
    import threading

    original = trl_utils._ChunkedLogProbFunction
    count = 4
    turns = [threading.Event() for _ in range(2 * count + 1)]
    seen: dict[int, tuple[bool, object]] = {}

    def run(index: int) -> None:
        options = LinearCrossEntropyOptions(batch_chunk_size=index + 1)
        turns[index].wait(timeout=60)
        with lce_trl.patched(options):
            turns[index + 1].set()
            turns[count + index].wait(timeout=60)
            seen[index] = (lce_trl.is_patched(), trl_utils._ChunkedLogProbFunction)
            turns[count + index + 1].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    turns[0].set()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(seen) == list(range(count))
    assert all(patched and head is not original for patched, head in seen.values())
    assert not lce_trl.is_patched() and trl_utils._ChunkedLogProbFunction is original


def test_unpatch_leaves_a_later_patch_in_place(monkeypatch):
    """Another library patched the kernel on top of ours: unpatch keeps theirs (with a
    warning) instead of overwriting it with TRL's, and restores the attributes that are
    still ours."""
    original = trl_utils._ChunkedLogProbFunction
    # monkeypatch restores TRL's kernel after the test, whatever is left on top.
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", original)
    lce_trl.patch()
    ours = trl_utils._ChunkedLogProbFunction

    class TheirHead:
        def apply(self, *args):
            return ours.apply(*args)

    theirs = TheirHead()
    trl_utils._ChunkedLogProbFunction = theirs
    with pytest.warns(RuntimeWarning, match=r"trl\.trainer\.utils\._ChunkedLogProbFunction was"):
        lce_trl.unpatch()
    assert trl_utils._ChunkedLogProbFunction is theirs
    assert trl_utils._use_triton is chunked_logprob._use_triton
    assert not lce_trl.is_patched()


def test_unpatch_inside_an_open_block_is_refused():
    original = trl_utils._ChunkedLogProbFunction
    with lce_trl.patched():
        with pytest.raises(RuntimeError, match=r"patched\(\) block\(s\) are open"):
            lce_trl.unpatch()
        assert lce_trl.is_patched()
    assert not lce_trl.is_patched() and trl_utils._ChunkedLogProbFunction is original


def test_patch_is_idempotent_and_updates_options_in_place():
    """Patching again keeps the one replacement (a wrapper holding it sees the new
    options) and the original TRL head to restore."""
    original = trl_utils._ChunkedLogProbFunction
    lce_trl.patch()
    installed = trl_utils._ChunkedLogProbFunction
    options = LinearCrossEntropyOptions(batch_chunk_size=3)
    lce_trl.patch(options)
    assert trl_utils._ChunkedLogProbFunction is installed and installed.options is options
    lce_trl.unpatch()
    lce_trl.unpatch()
    assert trl_utils._ChunkedLogProbFunction is original


# --- real trainers ------------------------------------------------------------------------

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "log",
    "big",
    "small",
    "red",
    "blue",
    "and",
    "then",
]
# Timings, which differ between any two runs.
UNSTABLE = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def _sentences(count: int, low: int, high: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(low, high))) for _ in range(count)]


class _Gradients(TrainerCallback):
    """Every parameter's gradient before each optimizer step (after clipping)."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters()})


def _common(tmp_path) -> dict:
    # bf16=False: TRL's configs default to bf16 autocast, also on CPU.
    return dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )


def _sft(tmp_path):
    config = trl.SFTConfig(**_common(tmp_path))
    data = Dataset.from_dict({"text": _sentences(8, 4, 12, 0)})
    return lambda callback: trl.SFTTrainer(
        model=_llama(),
        args=config,
        train_dataset=data,
        processing_class=_tokenizer(),
        callbacks=[callback],
    )


def _dpo(tmp_path):
    # use_weighting: WPO weights, TRL's one user of log_sum_sq_probs.
    config = trl.DPOConfig(use_weighting=True, **_common(tmp_path))
    data = Dataset.from_dict(
        {
            "prompt": _sentences(8, 3, 5, 1),
            "chosen": _sentences(8, 2, 6, 2),
            "rejected": _sentences(8, 2, 6, 3),
        }
    )
    return lambda callback: trl.DPOTrainer(
        model=_llama(),
        ref_model=_llama(),
        args=config,
        train_dataset=data,
        processing_class=_tokenizer(),
        callbacks=[callback],
    )


def _reward(completions, **kwargs):
    return [len(c.split()) + 2.0 * c.count("cat") for c in completions]


def _grpo(tmp_path):
    # temperature: the fused head's; entropy_coef: a gradient through the entropy.
    config = trl.GRPOConfig(
        num_generations=2,
        max_completion_length=6,
        temperature=0.8,
        entropy_coef=0.01,
        **_common(tmp_path),
    )
    data = Dataset.from_dict({"prompt": _sentences(8, 3, 5, 4)})
    return lambda callback: trl.GRPOTrainer(
        model=_llama(),
        reward_funcs=_reward,
        args=config,
        train_dataset=data,
        processing_class=_tokenizer(),
        callbacks=[callback],
    )


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of TRL's own kernel (forward and backward)."""
    calls = {"forward": 0, "backward": 0}
    kernel = chunked_logprob.ChunkedLogProbFunction
    for name in calls:
        original = getattr(kernel, name)

        @functools.wraps(original)
        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(kernel, name, staticmethod(counted))
    return calls


def _train(make) -> tuple[list[dict], list[dict]]:
    gradients = _Gradients()
    trainer = make(gradients)
    trainer.train()
    logs = [
        {k: v for k, v in entry.items() if k not in UNSTABLE} for entry in trainer.state.log_history
    ]
    return logs, gradients.steps


@pytest.mark.parametrize("trainer", [_sft, _dpo, _grpo], ids=["sft", "dpo", "grpo"])
def test_trainer_patched_equals_unpatched(tmp_path, kernel_calls, trainer):
    """Two steps from the same weights and data: every logged value (loss, entropy,
    mean_token_accuracy, DPO's rewards and logits, GRPO's rewards...) and every parameter's
    gradient; the first step's within fp32 rounding, the second's after one AdamW update
    of rounding-level differences. TRL's kernel runs only when unpatched."""
    make = trainer(tmp_path)
    logs, grads = _train(make)
    assert kernel_calls["forward"] > 0 and kernel_calls["backward"] > 0
    kernel_calls.update(forward=0, backward=0)
    with lce_trl.patched():
        patched_logs, patched_grads = _train(make)
    assert kernel_calls == {"forward": 0, "backward": 0}

    metrics = {k for entry in logs for k in entry}
    assert {"loss", "entropy"} <= metrics
    assert trainer is _grpo or "mean_token_accuracy" in metrics
    assert len(patched_logs) == len(logs) and len(patched_grads) == len(grads) == 2
    for step, (entry, patched_entry) in enumerate(zip(logs, patched_logs, strict=True)):
        assert entry.keys() == patched_entry.keys()
        bound = 16 * F32 if step == 0 else 1e-4
        for key, value in entry.items():
            assert math.isclose(patched_entry[key], value, rel_tol=bound, abs_tol=bound), key
    for step, (step_grads, patched_step) in enumerate(zip(grads, patched_grads, strict=True)):
        bound = 16 * F32 if step == 0 else 1e-4
        for name, grad in step_grads.items():
            assert rel_err(patched_step[name], grad) <= bound, (step, name)


def test_example_runs_at_a_tiny_size(tmp_path):
    """``examples/sft_with_trl.py`` end to end, small enough for CI: both runs, the same
    losses, the speed and memory lines."""
    script = pathlib.Path(__file__).parent.parent / "examples" / "sft_with_trl.py"
    args = ["--vocab", "120", "--hidden", "16", "--layers", "1", "--batch", "2"]
    args += ["--seq", "8", "--steps", "2", "--threads", "1"]
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    losses = [line.split()[1:] for line in lines if line.split()[:1] in (["1"], ["2"])]
    assert len(losses) == 2
    for trl_loss, patched_loss in losses:
        assert math.isclose(float(trl_loss), float(patched_loss), rel_tol=1e-5)
    assert sum("s/step" in line and "peak RSS during a step" in line for line in lines) == 2
    assert lines[-1].startswith("speed-up of a training step:")
