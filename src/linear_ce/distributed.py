r"""Heads split along the vocabulary over ``torch.distributed``.

Tensor-parallel training shards the output projection along the vocabulary:
rank :math:`r` of a process group holds rows
:math:`[\mathrm{start}_r, \mathrm{start}_r + V_r)` of :math:`W` (and of the
bias), while every rank holds the same hidden states, targets, class weights
and token weights. Each rank runs the ordinary chunk loop
(:mod:`linear_ce.engine.chunk_loop`) on its shard; per chunk of rows and output position
the row statistics are combined with two collectives,

.. math::

    m_i = \max_r \max_{j \in r} s_{ij} \quad (\text{all\_reduce MAX}),
    \qquad
    \Big[\sum_j e^{s_{ij} - m_i},\; \sum_j a_{ij}(s_{ij} - m_i)\Big]
    \quad (\text{one all\_reduce SUM of a } (B, 2) \text{ tensor}),

after which the loss and the log-sum-exp are identical on every rank. The
logit gradient of a class lives on the rank that holds it, so ``grad_W`` and
``grad_b`` stay local, while the input gradient
:math:`\sum_r G_r W_r` is summed over ranks by one all_reduce of ``N·F``
values per call.

Collectives per call, with ``K = Σ_p ⌈N_p / B⌉`` chunks of ``B`` rows over the
``P`` output positions (``P = 1`` for ordinary ``(V, F)`` weights), where
``N_p`` counts the rows whose target at position ``p`` is not ``ignore_index``
(every rank sees the same targets, so every rank skips the same rows and runs
the same chunks):

- ``reduction`` "mean"/"sum": ``2·K`` all_reduce in forward, plus one
  all_reduce of the input gradient (in forward, where the gradients are
  computed) when ``input`` requires grad; backward communicates nothing, unless a
  returned lse gets a gradient: then backward recomputes as for ``"none"``.
- ``reduction="none"``: ``2·K`` in forward; backward recomputes the chunks,
  ``2·K`` again, plus one all_reduce of the input gradient.
- one all_gather of the shard sizes when the :class:`VocabParallel` does not give
  ``vocab_start``/``num_classes`` (see :func:`shard_layout` to do it once and pass the result).

:func:`linear_ce.linear_cross_entropy` runs this when its ``vocab_parallel`` argument is a
:class:`VocabParallel` (the group, the shard's first class, the vocabulary's size); every
other head takes the same argument: :func:`linear_ce.token_logprobs` and
:func:`linear_ce.token_objective` for the per-token heads (``topk=k``: one
all_gather of each rank's ``(N, k)`` candidates and one of their ids, after the loop),
:func:`linear_ce.sequence_objective` for losses of whole sequences (chunks of whole groups,
the same two all_reduce per chunk), :func:`linear_ce.linear_divergence` for two heads split
alike, :func:`linear_ce.sparse_divergence` for a stored teacher's top-k (its support split
across the shards); each function's ``vocab_parallel`` entry lists its collectives. DTensor
arguments reach the same path through :mod:`linear_ce.parallel.dtensor`: a head placed
``Shard(0)`` gives the :class:`VocabParallel` itself.

Only ``torch.distributed`` collectives are used, so any backend that
implements all_reduce (MAX, SUM) and all_gather works: gloo for CPU tensors,
NCCL for CUDA tensors.

This module holds what is not a head: :class:`VocabParallel`, :func:`shard_layout` (the
gathered layout, once) and :class:`VocabShard` (the vocabulary the ops run on).
"""

from linear_ce.parallel.shard import VocabParallel, VocabShard, shard_layout

__all__ = ["VocabParallel", "VocabShard", "shard_layout"]
