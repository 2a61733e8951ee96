r"""The loss of every option combination, written out in float64 (the tests' reference).

For row :math:`i` of the flattened batch and position :math:`p` of a
K-dimensional loss (``P = d1·…·dK`` positions; one without), the logits are
:math:`s_{icp} = (x_i \cdot W_{cp} + b_{cp})\,\sigma`, softcapped to
:math:`c\,\tanh(s/c)`, then divided by the temperature :math:`T`;
:math:`\mathrm{lse}_{ip} = \log\sum_c e^{s_{icp}}` and
:math:`l_{icp} = s_{icp} - \mathrm{lse}_{ip}`. With class weights :math:`w`
(ones if none), label smoothing :math:`\varepsilon` and :math:`C` classes the
target weights are

- class index :math:`t_{ip}`: :math:`a_{icp} = v_{ip}\,w_c\,((1-\varepsilon)[c = t_{ip}] + \varepsilon/C)`,
  row weight :math:`\omega_{ip} = v_{ip}\,w_{t_{ip}}`, where :math:`v_{ip}` is 0 on
  ignored rows, 1 elsewhere;
- probabilities :math:`q_{icp}`: :math:`a_{icp} = w_c\,((1-\varepsilon)\,q_{icp} + \varepsilon/C)`,
  :math:`\omega_{ip} = 1`.

The row loss is :math:`\tau_{ip}\,(-\sum_c a_{icp}\,l_{icp} + \lambda\,\omega_{ip}\,\mathrm{lse}_{ip}^2)`
with token weight :math:`\tau` and z-loss :math:`\lambda`; "sum" adds the rows,
"mean" divides that sum by :math:`\sum\omega` (no token weights in it). The
z-loss term alone is reduced the same way. ``shift=k`` scores position ``t``
of the sequence (the last batch dimension) against label ``t + k`` and ignores
the last ``k`` positions. The reported lse of an ignored row is 0 (no loss is
computed for it). Nothing here calls ``cross_entropy``.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Expected:
    """Loss, z-loss term and lse (shaped as the caller sees them) and the gradients of
    ``x``, ``W`` and ``b`` (``None`` for an absent bias), all float64."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    lse: torch.Tensor
    grads: list[torch.Tensor | None]


def _shift_labels(target: torch.Tensor, shift: int, ignore_index: int) -> torch.Tensor:
    out = torch.full_like(target, ignore_index)
    length = target.shape[-1]
    if shift < length:
        out[..., : length - shift] = target[..., shift:]
    return out


def loss_formula(
    x: torch.Tensor,
    W: torch.Tensor,
    target: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    shift: int = 0,
    token_weight: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
    upstream: torch.Tensor | float = 1.0,
) -> Expected:
    """The module doc's formula in float64 for ``x`` ``(*batch, F)``, ``W``
    ``(C, *out, F)``, ``target`` ``(*batch, *out)`` indices or ``(*batch, C, *out)``
    probabilities; gradients by autograd with ``upstream`` (shaped like the loss)."""
    x64 = x.detach().double().requires_grad_()
    W64 = W.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    batch, out = tuple(x.shape[:-1]), tuple(W.shape[1:-1])
    classes, features = W.shape[0], W.shape[-1]
    rows = x64.reshape(-1, features).shape[0]
    positions = W64.reshape(classes, -1, features).shape[1]

    s = torch.einsum(
        "rf,cpf->rcp", x64.reshape(rows, features), W64.reshape(classes, positions, features)
    )
    if b64 is not None:
        s = s + b64.reshape(1, classes, positions)
    s = s * logit_scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s / temperature
    lse = torch.logsumexp(s, dim=1)
    log_p = s - lse[:, None, :]

    w = torch.ones(classes, dtype=torch.float64)
    if class_weight is not None:
        w = class_weight.detach().double()
    eps = label_smoothing
    if target.is_floating_point():
        q = target.detach().double().reshape(rows, classes, positions)
        a = w[None, :, None] * ((1 - eps) * q + eps / classes)
        omega = torch.ones(rows, positions, dtype=torch.float64)
        reported_lse = lse
    else:
        labels = target.long()
        if shift:
            labels = _shift_labels(labels, shift, ignore_index)
        labels = labels.reshape(rows, positions)
        valid = (labels != ignore_index).double()
        safe = torch.where(labels != ignore_index, labels, 0)
        one_hot = torch.zeros(rows, classes, positions, dtype=torch.float64)
        one_hot.scatter_(1, safe[:, None, :], 1.0)
        a = valid[:, None, :] * w[None, :, None] * ((1 - eps) * one_hot + eps / classes)
        omega = valid * w[safe]
        reported_lse = torch.where(labels != ignore_index, lse, 0.0)

    tau = torch.ones(rows, positions, dtype=torch.float64)
    if token_weight is not None:
        tau = token_weight.detach().double().reshape(rows, positions)
    z_rows = tau * z_loss * omega * lse.square()
    row_loss = tau * -(a * log_p).sum(dim=1) + z_rows

    if reduction == "none":
        loss, z_term = row_loss.reshape(*batch, *out), z_rows.reshape(*batch, *out)
    else:
        denominator = omega.sum() if reduction == "mean" else 1.0
        loss, z_term = row_loss.sum() / denominator, z_rows.sum() / denominator
    upstream = torch.as_tensor(upstream, dtype=torch.float64).expand(loss.shape)
    leaves = [t for t in (x64, W64, b64) if t is not None]
    found = iter(torch.autograd.grad(loss, leaves, upstream))
    grads = [next(found) if t is not None else None for t in (x64, W64, b64)]
    lse_out = reported_lse.reshape(*batch, *out).detach()
    return Expected(loss.detach(), z_term.detach(), lse_out, grads)
