"""The loop over row chunks: pure math on a :class:`~linear_ce.plan.Plan`.

Per chunk of ``B`` rows and each output position: logits ``S = x Wᵀ + b``
(softcapped), row max, log-sum-exp, the loss terms of :mod:`linear_ce.rows`,
then — only if gradients are wanted — ``S`` becomes ``∂loss/∂logits`` in
place and the two gradient GEMMs consume it. Nothing here grows with ``N·V``:
the one ``(B, V)`` buffer (two with softcap) is reused by every chunk.
"""

from __future__ import annotations

import dataclasses

import torch

from linear_ce.accumulate import weight_grad_sum
from linear_ce.arguments import Call
from linear_ce.plan import Plan
from linear_ce.rows import RowTerms
from linear_ce.vocab import LocalVocab

__all__ = ["ChunkResult", "run_chunks"]


@dataclasses.dataclass
class ChunkResult:
    """Per-row loss ``τ·ℓ`` and log-sum-exp ``(N, P)`` in the accumulation dtype,
    and the requested gradients in the input dtype (``None`` where not asked)."""

    row_loss: torch.Tensor
    lse: torch.Tensor
    grad_input: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None


def run_chunks(
    call: Call,
    terms: RowTerms,
    plan: Plan,
    *,
    grad_input: bool,
    grad_weight: bool,
    grad_bias: bool,
    vocab: LocalVocab | None = None,
) -> ChunkResult:
    """Loss rows and gradients of ``call``; gradients carry the row scale ``terms.scale``."""
    vocab = vocab or LocalVocab()
    x, weight, bias = call.input, call.linear_weight, call.linear_bias
    rows, in_features = x.shape
    local_classes, positions, _ = weight.shape
    acc, device = plan.acc_dtype, x.device
    gemm = plan.gemm
    want_grads = grad_input or grad_weight or grad_bias
    softcap = call.softcap
    gamma = terms.gamma
    smoothing = call.label_smoothing > 0.0

    chunk = min(plan.rows_per_chunk, max(rows, 1))
    logits_buf = gemm.logits_buffer(chunk, local_classes, acc, device)
    softcap_buf = torch.empty_like(logits_buf) if softcap is not None else None

    row_loss = torch.zeros((rows, positions), dtype=acc, device=device)
    lse_out = torch.zeros((rows, positions), dtype=acc, device=device)
    grad_x = torch.zeros((rows, in_features), dtype=acc, device=device) if grad_input else None
    grad_w = weight_grad_sum(plan, weight.shape, device) if grad_weight else None
    grad_b = (
        torch.zeros((local_classes, positions), dtype=acc, device=device) if grad_bias else None
    )

    class_weight = terms.class_weight
    if class_weight is not None:
        class_weight = class_weight[vocab.start : vocab.start + local_classes]
    stats = torch.empty((chunk, 2), dtype=acc, device=device)

    for p in range(positions):
        w_op = gemm.weight_operand(weight[:, p, :])
        b_p = None if bias is None else bias[:, p].to(acc)
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            n = stop - start
            x_op = gemm.operand(x[start:stop])
            S = logits_buf[:n]
            gemm.logits(S, x_op, w_op)
            if b_p is not None:
                S.add_(b_p)
            if softcap is not None:
                D = softcap_buf[:n]
                S.div_(softcap)
                # tanh' = sech², not 1 - tanh²: the latter cancels to nothing where
                # tanh saturates, losing every digit of the gradient of large logits.
                torch.cosh(S, out=D).reciprocal_().square_()
                S.tanh_().mul_(softcap)

            row_max = S.amax(dim=1)
            vocab.max_(row_max)
            S.sub_(row_max[:, None])

            # Σ_j a_ij (s_ij − max): the target logit, the smoothing term, the soft target.
            lin = stats[:n, 1]
            if terms.target is not None:
                local_t = terms.target[start:stop, p] - vocab.start
                owned = (local_t >= 0) & (local_t < local_classes)
                safe_t = torch.where(owned, local_t, 0)
                picked = S.gather(1, safe_t[:, None])[:, 0]
                torch.mul(picked, terms.alpha[start:stop, p] * owned, out=lin)
            else:
                lin.zero_()
            beta = terms.beta[start:stop, p]
            if smoothing:
                lin.addcmul_(beta, S.sum(1) if class_weight is None else S @ class_weight)
            if terms.target is None:
                q = call.target[start:stop, vocab.start : vocab.start + local_classes, p].to(acc)
                if class_weight is not None:
                    q = q * class_weight
                lin.add_((q * S).sum(1), alpha=gamma)

            S.exp_()
            sum_exp = stats[:n, 0]
            torch.sum(S, dim=1, out=sum_exp)
            vocab.sum_(stats[:n])
            log_sum_exp = sum_exp.log()
            # A ±inf row max is the lse itself (as torch.logsumexp), not inf − inf = NaN.
            lse = torch.where(row_max.isinf(), row_max, row_max + log_sum_exp)
            A = terms.A[start:stop, p]
            zeta = terms.zeta[start:stop, p]
            loss = A * log_sum_exp - lin + zeta * lse.square()
            valid = terms.valid[start:stop, p]
            row_loss[start:stop, p] = torch.where(valid, loss, 0.0) * terms.token[start:stop, p]
            lse_out[start:stop, p] = lse
            if not want_grads:
                continue

            # ∂/∂s = r·((A + 2ζ·lse)·p − a): S holds exp(s − max) here.
            r = terms.scale[start:stop, p]
            S.mul_((r * (A + 2.0 * zeta * lse) / sum_exp)[:, None])
            if terms.target is not None:
                S.scatter_add_(
                    1, safe_t[:, None], (-(r * terms.alpha[start:stop, p]) * owned)[:, None]
                )
            else:
                S.addcmul_(q, (r * gamma)[:, None], value=-1.0)
            if smoothing:
                if class_weight is None:
                    S.sub_((r * beta)[:, None])
                else:
                    S.addr_(r * beta, class_weight, alpha=-1.0)
            if softcap is not None:
                S.mul_(D)

            if grad_bias:
                grad_b[:, p].add_(S.sum(0))
            if grad_input or grad_weight:
                g_op = gemm.operand(S)
            if grad_input:
                gemm.add_grad_input(grad_x[start:stop], g_op, w_op)
            if grad_weight:
                grad_w.add(p, g_op, x_op)

    out_dtype = plan.input_dtype
    return ChunkResult(
        row_loss=row_loss,
        lse=lse_out,
        grad_input=None if grad_x is None else grad_x.to(out_dtype),
        grad_weight=None if grad_w is None else grad_w.finish(),
        grad_bias=None if grad_b is None else grad_b.to(out_dtype),
    )
