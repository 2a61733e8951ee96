r"""Sequence objectives written out from the full logits (the tests' reference).

Logits :math:`s = \mathrm{softcap}((x W^\top + b)\sigma) / T`, ``log_softmax`` over the
vocabulary, the target's log-probability per position; a position is scored when its
label (``shift`` places on, along the last dimension) is not ``ignore_index``, belongs to
a sequence and, with a shift, to the same sequence as the position. Sums per sequence by
a one-hot product. Nothing here calls linear_ce; the preference and policy losses are
typed again from their papers / TRL's trainers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


def token_terms(x, W, b, t, ids, *, shift=0, temperature=1.0, logit_scale=1.0, softcap=None):
    """Per position (target's shape): ``(logprob, entropy, scored)``, zero where not scored.
    ``ids``: the sequence id of each position (target's shape, -1: none)."""
    k = int(shift)
    length = t.shape[-1]
    labels = torch.full_like(t, -100)
    labels[..., : length - k] = t[..., k:]
    same = torch.zeros_like(t, dtype=torch.bool)
    same[..., : length - k] = ids[..., : length - k] == ids[..., k:]
    scored = (labels != -100) & (ids >= 0) & same
    s = x @ W.T
    if b is not None:
        s = s + b
    s = s * logit_scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    logp = torch.log_softmax(s / temperature, -1)
    lp = logp.gather(-1, torch.where(scored, labels, 0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=lp.dtype)
    return torch.where(scored, lp, zero), torch.where(scored, ent, zero), scored


def per_sequence(values, ids, scored, sequences):
    """``values`` (target's shape) summed over each sequence's scored positions: ``(S,)``."""
    onehot = (ids.reshape(-1, 1) == torch.arange(sequences)) & scored.reshape(-1, 1)
    return (values.reshape(-1, 1) * onehot.to(values.dtype)).sum(0)


def split(values):
    """TRL's concatenated batch: the first half chosen, the second rejected."""
    half = values.shape[0] // 2
    return values[:half], values[half:]


def dpo_loss(loss_type, lp, ref, n, beta, *, eps=0.0, fdiv="reverse_kl", alpha=0.5, tau=0.05):
    """Per pair, as TRL 1.16's ``DPOTrainer._compute_loss``."""
    (lc, lr), (rc, rr), (nc, nr) = split(lp), split(ref), split(n)
    chosen, rejected = lc - rc, lr - rr

    def score(v):
        if fdiv == "reverse_kl":
            return v
        if fdiv == "forward_kl":
            return 1 - torch.exp(-v)
        if fdiv == "js_divergence":
            return math.log(2) + F.logsigmoid(v)
        return (torch.exp((alpha - 1) * v) - 1) / (alpha - 1)

    cs, rs = score(chosen), score(rejected)
    d = cs - rs
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps
    if loss_type == "hinge":
        return torch.relu(1 - beta * d)
    if loss_type == "ipo":
        return (cs / nc - rs / nr - 1 / (2 * beta)) ** 2
    if loss_type == "exo_pair":
        qw, ql = torch.sigmoid(beta * d), torch.sigmoid(-beta * d)
        return qw * (F.logsigmoid(beta * d) - math.log(1 - eps)) + ql * (
            F.logsigmoid(-beta * d) - math.log(eps)
        )
    if loss_type == "nca_pair":
        a, c = beta * chosen, beta * rejected
        return -F.logsigmoid(a) - 0.5 * F.logsigmoid(-a) - 0.5 * F.logsigmoid(-c)
    if loss_type == "robust":
        clean = -(1 - eps) * F.logsigmoid(beta * d)
        flipped = -eps * F.logsigmoid(-beta * d)
        return (clean - flipped) / (1 - 2 * eps)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
    if loss_type == "sppo_hard":
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * (chosen - rejected))
    if loss_type == "discopop":
        z = beta * d
        m = torch.sigmoid(z / tau)
        return -F.logsigmoid(z) * (1 - m) + torch.exp(-z) * m
    if loss_type == "sft":
        # TRL: the mean of the chosen tokens' -log p over the batch, repeated per pair.
        return (-lc.sum() / nc.sum()).expand(lc.shape)
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(beta * (cs / nc - rs / nr))
    raise ValueError(loss_type)


def cpo_loss(loss_type, lp, n, beta, *, cpo_alpha, eps=0.0, gamma=0.5, alpha=0.0):
    """Per pair plus the batch NLL term, as TRL's ``CPOTrainer`` (``losses.mean() +
    cpo_alpha * nll`` equals the mean of this over pairs)."""
    (lc, lr), (nc, nr) = split(lp), split(n)
    avg = loss_type in ("ipo", "simpo")
    c, r = (lc / nc, lr / nr) if avg else (lc, lr)
    if alpha != 0:
        c = (1 - torch.exp(c).pow(-alpha)) / alpha
        r = (1 - torch.exp(r).pow(-alpha)) / alpha
    logits = c - r
    if loss_type == "simpo":
        logits = logits - gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        loss = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * logits)
    else:
        loss = (logits - 1 / (2 * beta)) ** 2
    nll = -lc.sum() / nc.sum()
    return loss + cpo_alpha * nll


def orpo_loss(lp, n, beta, *, nll="batch"):
    """Per pair, TRL's ``ORPOTrainer``: ``nll - beta * logsigmoid(log_odds)``."""
    (lc, lr), (nc, nr) = split(lp), split(n)
    c, r = lc / nc, lr / nr
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    nll_term = -lc.sum() / nc.sum() if nll == "batch" else -c
    return nll_term - beta * F.logsigmoid(log_odds)


def kto_loss(lp, ref, label, beta, *, kl=0.0, wd=1.0, wu=1.0, loss_type="kto"):
    """Per sequence, TRL's ``KTOTrainer``."""
    rho = lp - ref
    if loss_type == "kto":
        good = 1 - torch.sigmoid(beta * (rho - kl))
        bad = 1 - torch.sigmoid(beta * (kl - rho))
    else:
        good, bad = 1 - torch.sigmoid(beta * rho), torch.sigmoid(beta * rho)
    return torch.where(label, wd * good, wu * bad)


def gspo_loss(lp, old, n, adv, lo, hi, delta=None):
    """Per sequence, TRL's GRPO with ``importance_sampling_level="sequence"``."""
    coef = torch.exp((lp - old) / n)
    clipped = torch.clamp(coef, 1 - lo, 1 + hi)
    if delta is not None:
        coef = torch.clamp(coef, max=delta)
    return -torch.min(coef * adv, clipped * adv)


class GemmWork(TorchDispatchMode):
    """Counts the matrix products run inside it (``aten.mm``/``addmm``, in place or not)
    and their multiply-adds, ``m·k·n`` each."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.work = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = args[:2] if name == "mm" else args[1:3]
            self.calls += 1
            self.work += a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))

    def passes(self, rows: int, classes: int, features: int) -> float:
        """The work in units of one ``rows × classes × features`` GEMM."""
        return self.work / (rows * classes * features)
