"""The heads under ``torch.autocast`` (issue 29, item 14).

TRL's trainer configs turn on bf16 autocast by default, also on CPU. Three claims:

- autocast does not reach inside a head: every gradient is bitwise the one of the same call
  without autocast (the plan decides each GEMM's dtypes; before, a product written ``a @ b``
  ran in bf16 under autocast);
- fp32 parameters under autocast get fp32 gradient sums: within fp32's bound of float64, on
  every path (the chunk loop with gradients in forward, its recomputing backward, the
  vocabulary pass);
- in TRL's SFT trainer with its default config and in a transformers model patched for the
  loss, the head's gradients are at least as close to float64 as those of the head replaced.

References are float64 expressions written here.
"""

from __future__ import annotations

import pytest
import torch

import linear_ce
from conftest import eps, rel_err
from linear_ce import LinearCrossEntropyOptions

F32 = eps(torch.float32)
N, F, V, F_TEACHER = 160, 24, 300, 16


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, F, generator=g, dtype=torch.float64)
    W = torch.randn(V, F, generator=g, dtype=torch.float64) * 2 / F**0.5
    xt = torch.randn(N, F_TEACHER, generator=g, dtype=torch.float64)
    Wt = torch.randn(V, F_TEACHER, generator=g, dtype=torch.float64) * 2 / F_TEACHER**0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.3] = -100
    up = torch.randn(2, N, generator=g, dtype=torch.float64)
    return x, W, xt, Wt, t, up


def _vjp_loss(x, W, t, up, row_stats: bool, options):
    """``token_logprobs_vjp``'s gradients as a differentiable stand-in: a function whose
    gradient is what the vjp returns (with the forward's statistics: the vocabulary pass;
    without: the chunk loop reruns)."""
    stats = None
    if row_stats:
        stats = linear_ce.token_logprobs_and_stats(
            x.detach(), W.detach(), t, entropy=True, options=options
        )[1]
    gx, gW, _ = linear_ce.token_logprobs_vjp(
        x.detach(), W.detach(), t, up[0], up[1], row_stats=stats, options=options
    )
    return (x * gx).sum() + (W * gW).sum()


def _head_loss(head: str, x, W, xt, Wt, t, up, options):
    """A scalar whose gradient with respect to ``(x, W)`` is the head's, for each public head
    and each of its gradient paths."""
    if head == "ce-mean":  # the chunk loop, gradients in forward
        return linear_ce.linear_cross_entropy(x, W, t, options=options).float()
    if head == "ce-none":  # the chunk loop, recomputed in backward
        rows = linear_ce.linear_cross_entropy(x, W, t, reduction="none", options=options)
        return (rows.float() * up[0]).sum()
    if head == "token_logprobs":  # the vocabulary pass
        out = linear_ce.token_logprobs(x, W, t, entropy=True, options=options)
        return (out.logprob * up[0]).sum() + (out.entropy * up[1]).sum()
    if head in ("vjp-stats", "vjp-rerun"):
        return _vjp_loss(x, W, t, up.to(torch.float32), head == "vjp-stats", options)
    if head == "token_objective":
        return linear_ce.token_objective(
            x, W, t, lambda lp, ent, a: -a * lp, a=up[0], options=options
        )
    if head == "divergence":
        return linear_ce.linear_divergence(x, W, xt, Wt, t, beta=0.5, options=options)
    raise AssertionError(head)


HEADS = ["ce-mean", "ce-none", "token_logprobs", "vjp-stats", "vjp-rerun", "token_objective"]
HEADS += ["divergence"]


def _grads(head, dtype, options, autocast: bool, seed: int = 0):
    x, W, xt, Wt, t, up = _inputs(seed)
    x, W = (v.to(dtype).requires_grad_() for v in (x, W))
    # Upstream gradients representable in ``dtype``: under autocast the per-row losses are
    # reported in fp32, outside it in ``dtype``, whose cast would round them otherwise.
    up = up.to(dtype).to(torch.float64 if dtype == torch.float64 else torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = _head_loss(head, x, W, xt.to(dtype), Wt.to(dtype), t, up, options)
    return torch.autograd.grad(loss, (x, W))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "forced-upcast"])
@pytest.mark.parametrize("policy", ["auto", "compact"])
def test_autocast_does_not_reach_inside_a_head(monkeypatch, head, dtype, native, policy):
    """Every head's gradients under bf16 autocast are bitwise those without it, on both CPU
    GEMM paths, with the weight gradient summed in fp32 (``auto``) or in the half result
    (``compact``, and ``auto`` over few chunks)."""
    monkeypatch.setenv("LINEAR_CE_NATIVE_HALF_GEMM", native)
    options = LinearCrossEntropyOptions(acc_policy=policy)
    plain = _grads(head, dtype, options, autocast=False)
    under = _grads(head, dtype, options, autocast=True)
    for a, b in zip(under, plain, strict=True):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)


def _plain_grads(head, dtype):
    """The gradients of each head's plain expression on the full logits, computed in
    ``dtype`` (float64: the reference; float32: the plain expression's own error)."""
    x, W, xt, Wt, t, up = (v.to(dtype) if v.is_floating_point() else v for v in _inputs(0))
    x, W = x.requires_grad_(), W.requires_grad_()
    valid = t != -100
    logp = torch.log_softmax(x @ W.T, -1)
    lp = torch.where(valid, logp.gather(-1, torch.where(valid, t, 0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    if head == "ce-mean":
        loss = -lp.sum() / valid.sum()
    elif head == "ce-none":
        loss = -(lp * up[0]).sum()
    elif head in ("token_logprobs", "vjp-stats", "vjp-rerun"):
        loss = (lp * up[0]).sum() + (ent * up[1]).sum()
    elif head == "token_objective":
        loss = -(up[0] * lp).sum()
    else:  # the generalised JSD at beta = 0.5 against the teacher, mean over valid rows
        p_s, p_t = logp.exp(), torch.softmax(xt @ Wt.T, -1)
        m = 0.5 * (p_s + p_t)
        jsd = 0.5 * (p_t * (p_t.log() - m.log())).sum(-1) + 0.5 * (p_s * (logp - m.log())).sum(-1)
        loss = torch.where(valid, jsd, 0.0).sum() / valid.sum()
    return torch.autograd.grad(loss, (x, W))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("chunks", [None, 32], ids=["auto-chunks", "32-row-chunks"])
def test_fp32_parameters_under_autocast_get_fp32_sums(head, chunks):
    """fp32 parameters under bf16 autocast: each head computes in fp32 and returns fp32
    gradient sums, within 3 eps(fp32) of float64 or 2x the plain fp32 expression's own
    error (a gradient rounded to bf16 anywhere would be ~1e-3 off)."""
    options = LinearCrossEntropyOptions(batch_chunk_size=chunks)
    got = _grads(head, torch.float32, options, autocast=True)
    want = _plain_grads(head, torch.float64)
    plain = _plain_grads(head, torch.float32)
    for g, w, p in zip(got, want, plain, strict=True):
        err, own = rel_err(g, w), rel_err(p, w)
        assert g.dtype == torch.float32 and err <= max(3 * F32, 2 * own), (err, own)


# --- the heads replaced: TRL's fused LM head, a transformers model's own head ---------------


class _HeadRecorder:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction`` around the head in use
    (TRL's kernel or the patched one): records each call's hidden states, weight, targets
    and temperature, the upstream gradient of the log-probabilities and the gradients the
    head returns for the hidden states and the weight."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def apply(self, hidden, weight, bias, targets, temperature, *rest):
        call = {"h": hidden.detach().clone(), "W": weight.detach().clone(), "t": targets.clone()}
        call["temperature"], call["autocast"] = temperature, torch.is_autocast_enabled("cpu")
        hidden.register_hook(lambda g: call.__setitem__("grad_h", g.clone()))
        handle = []

        def on_weight(g):
            call["grad_W"] = g.clone()
            handle[0].remove()

        handle.append(weight.register_hook(on_weight))
        out = self.inner.apply(hidden, weight, bias, targets, temperature, *rest)
        out[0].register_hook(lambda g: call.__setitem__("up", g.clone()))
        self.calls.append(call)
        return out


def _head_errors(call) -> tuple[float, float]:
    """Relative errors of the recorded hidden-state and weight gradients against float64
    on the same (unrounded) inputs, over the positions that carry a loss."""
    keep = call["up"] != 0  # TRL's CPU path also scores ignored positions, with zero gradient
    h = call["h"][keep].double().requires_grad_()
    W = call["W"].double().requires_grad_()
    logp = torch.log_softmax(h @ W.T / call["temperature"], -1)
    lp = logp.gather(-1, call["t"][keep][:, None])[:, 0]
    grad_h, grad_W = torch.autograd.grad((lp * call["up"][keep].double()).sum(), (h, W))
    return rel_err(call["grad_h"][keep], grad_h), rel_err(call["grad_W"], grad_W)


def _sft_step(tmp_path, patched: bool, seed: int):
    """One SFT step of TRL's trainer with its default config (bf16 autocast on), a tiny fp32
    Llama; the head's recorded call."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from trl.trainer import utils as trl_utils

    from linear_ce.integrations import trl as lce_trl
    from test_trl import _llama, _sentences, _tokenizer

    config = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
    )
    assert config.bf16  # TRL's default, also on CPU
    data = Dataset.from_dict({"text": _sentences(8, 4, 12, seed)})
    trainer = trl.SFTTrainer(
        model=_llama(seed), args=config, train_dataset=data, processing_class=_tokenizer()
    )
    if patched:
        lce_trl.patch()
    recorder = _HeadRecorder(trl_utils._ChunkedLogProbFunction)
    trl_utils._ChunkedLogProbFunction = recorder
    try:
        trainer.train()
    finally:
        trl_utils._ChunkedLogProbFunction = recorder.inner
        lce_trl.unpatch()
    assert len(recorder.calls) == 1 and recorder.calls[0]["autocast"]
    assert recorder.calls[0]["W"].dtype == torch.float32
    return recorder.calls[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_trl_sft_default_config_head_gradients_no_worse_than_trls(tmp_path, seed):
    """TRL's SFT trainer with its default config (bf16 autocast) and fp32 parameters, one
    step, patched and not: the head's hidden-state and weight gradients are at least as
    close to float64 (on the same inputs) as those of TRL's kernel, which sums them in fp32."""
    theirs = _head_errors(_sft_step(tmp_path / "trl", False, seed))
    ours = _head_errors(_sft_step(tmp_path / "linear_ce", True, seed))
    for got, peer in zip(ours, theirs, strict=True):
        assert got <= peer, (ours, theirs)


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config)


def _model_head_step(model, ids, labels):
    """One bf16-autocast training step of ``model``: the hidden states entering ``lm_head``
    and the gradients of the loss for them and for ``lm_head.weight``."""
    seen = {}

    def record(module, args):
        seen["h"] = args[0].detach().clone()
        args[0].register_hook(lambda g: seen.__setitem__("grad_h", g.clone()))

    handle = model.lm_head.register_forward_pre_hook(record)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
    finally:
        handle.remove()
    return seen["h"], seen["grad_h"], model.lm_head.weight.grad.clone()


def test_transformers_loss_under_autocast_no_worse_than_the_models_head():
    """A patched fp32 Llama under bf16 autocast: the head's hidden-state and weight gradients
    are at least as close to float64 (on the same hidden states) as the unpatched model's."""
    pytest.importorskip("transformers")
    from linear_ce.integrations import transformers as lce_hf

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (4, 40), generator=g)
    labels = ids.clone()
    labels[:, :10] = -100
    model = _tiny_llama()
    h, *theirs = _model_head_step(model, ids, labels)
    model.zero_grad()
    h_patched, *ours = _model_head_step(lce_hf.patch(model), ids, labels)
    assert torch.equal(h_patched, h)
    x = h.double().requires_grad_()
    W = model.lm_head.weight.detach().double().requires_grad_()
    logits = (x @ W.T)[:, :-1].reshape(-1, V)
    loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
    want = torch.autograd.grad(loss, (x, W))
    for got, peer, ref in zip(ours, theirs, want, strict=True):
        assert rel_err(got, ref) <= rel_err(peer, ref), (rel_err(got, ref), rel_err(peer, ref))
