r"""DTensor arguments: the public functions on a ``torch.distributed`` device mesh.

An entry point decorated with :func:`accepts_dtensors` takes DTensor arguments (tensor
parallelism, FSDP2, sequence parallelism, as torchtitan trains) as well as plain tensors.
The placements of its arguments say, per mesh dimension, what runs:

- the head (weight and bias) ``Shard(0)``: the vocabulary is split over that dimension's
  group and the call runs vocab-parallel (the function itself with ``vocab_parallel=`` the
  :class:`~linear_ce.parallel.shard.VocabParallel` the placements give, with the
  collectives of :mod:`linear_ce.distributed`);
- the input ``Shard(k)``, ``k`` a batch or sequence dimension, with a replicated head: the
  rows are split; every rank runs its own rows, and each scalar result (a ``"sum"``, a
  ``"mean"`` as global sum over global denominator) is summed over the dimension by one
  all_reduce, which also carries the denominator;
- the input ``Shard(k)`` on the dimension that splits the vocabulary: it is all-gathered
  first (as ``ColwiseParallel(input_layouts=Shard(1))`` does), then vocab-parallel;
- ``Replicate()`` everywhere: every rank runs the whole call.

Any other placement (``Partial``, a weight ``Shard(1)``, ``_StridedShard``, an input
sharded along its features) is an error that names it and its mesh dimension; so are
DTensors on different meshes and a mesh whose device type differs from a tensor's device.

A plain tensor argument stands for a replicated one: the whole value, the same on every rank
(per-token plain tensors are cut to this rank's rows locally). When any argument is a
DTensor the results are DTensors on its mesh: a scalar is ``Replicate()``, a per-token output
has the input's row placements. Gradients come back with the placements autograd expects:
the input's own, the head's own on the dimensions that do not split the rows, and
``Partial()`` for the head on the dimensions that do (each rank holds the sum over its rows,
as DTensor's own ``linear`` gives). A plain head with a split input gets that partial sum
as a plain tensor (what a data-parallel wrapper reduces).

The hook: a public function is decorated once, naming the roles of its arguments (here
the per-token ones, the head's, and that it takes a ``vocab_parallel`` argument)::

    @accepts_dtensors(rows=("input", "target"), heads=("linear_weight", "linear_bias"),
                      vocab_parallel=True)
    def token_logprobs(input, linear_weight, target, *, linear_bias=None, ...,
                       vocab_parallel=None): ...

The head's tensors must be split alike (a plain one counts as replicated). Four arguments are
read by name where the function has them: ``target``, ``shift`` and ``ignore_index`` (the labels
are shifted on the whole sequence when the sequence is split) and ``reduction`` (a ``"mean"``
over split rows runs as ``"sum"`` and is divided by the global denominator). Calls without a
DTensor argument go straight to the function.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from linear_ce.checks.call import DEFAULT_IGNORE_INDEX, shifted_target
from linear_ce.parallel.shard import VocabParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # a torch build without distributed support holds no DTensor
    DTensor = None

__all__ = ["accepts_dtensors"]

FunctionT = TypeVar("FunctionT", bound=Callable[..., Any])

#: ``mean(arguments, num_classes)``: the local denominator of ``reduction="mean"`` from the
#: call's arguments on this rank (its rows); ``num_classes`` is the whole vocabulary of a
#: vocab-parallel head, ``None`` for a whole head.
MeanDenominator = Callable[[Mapping[str, Any], "int | None"], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _Roles:
    """What each argument of a public function is, for laying it out on a mesh.

    ``rows``: ``(*batch, ...)`` arguments, the first of them the input whose placements
    split the rows; ``per_token_keywords``: the function's ``**kwargs`` are such arguments
    too. ``heads``: ``(V, ...)`` arguments, split along the vocabulary together. ``whole``:
    arguments every rank needs whole (class weights). ``vocab_parallel``: the function takes
    a ``vocab_parallel`` argument, for a vocabulary-split head. ``mean``: the local denominator of
    ``reduction="mean"``, for functions with a ``reduction`` argument. ``whole_sequences``:
    for a function of whole sequences, its packed-layout arguments (see
    :func:`accepts_dtensors`).
    """

    rows: tuple[str, ...]
    heads: tuple[str, ...]
    whole: tuple[str, ...]
    per_token_keywords: bool
    vocab_parallel: bool
    mean: MeanDenominator | None
    whole_sequences: tuple[str, ...] | None


def accepts_dtensors(
    *,
    rows: tuple[str, ...],
    heads: tuple[str, ...],
    whole: tuple[str, ...] = (),
    per_token_keywords: bool = False,
    vocab_parallel: bool = False,
    mean: MeanDenominator | None = None,
    whole_sequences: tuple[str, ...] | None = None,
) -> Callable[[FunctionT], FunctionT]:
    """Let a public function take DTensor arguments (see the module doc for the rules).

    Args:
        rows: names of the per-token arguments ``(*batch, ...)``; the first is the input.
        heads: names of the vocabulary-major arguments (weight, bias).
        whole: names of the arguments every rank needs whole (class weights).
        per_token_keywords: the function's ``**kwargs`` are per-token tensors too.
        vocab_parallel: the function takes a head split along the vocabulary through its
            ``vocab_parallel`` argument (a :class:`~linear_ce.parallel.shard.VocabParallel`);
            ``False``: such a head is an error.
        mean: the local denominator of ``reduction="mean"``, for a function with a
            ``reduction`` argument; its rows split over ranks then run ``"sum"``, and the
            scalar results are divided by the global denominator.
        whole_sequences: the function's loss is one of whole sequences (a row of a padded
            ``(B, T, ...)`` input each; these arguments lay out packed ones): rows may be
            split only along the batch dimension of a padded input, never along the
            sequence, nor while a packed-layout argument is given, since a split sequence
            would be scored in pieces. ``None``: any batch or sequence split.
    """
    roles = _Roles(rows, heads, whole, per_token_keywords, vocab_parallel, mean, whole_sequences)

    def decorate(function: FunctionT) -> FunctionT:
        signature = inspect.signature(function)
        if vocab_parallel and "vocab_parallel" not in signature.parameters:
            raise TypeError(f"{function.__name__} has no vocab_parallel argument")

        @functools.wraps(function)
        def entry_point(*args: Any, **kwargs: Any) -> Any:
            if DTensor is not None and _holds_dtensor(args, kwargs):
                return _on_mesh(function, signature, roles, args, kwargs)
            return function(*args, **kwargs)

        return entry_point  # type: ignore[return-value]

    return decorate


def _holds_dtensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(isinstance(value, DTensor) for value in (*args, *kwargs.values()))


# ----------------------------------------------------------------------------- the layout


def _mesh_dim(mesh: DeviceMesh, dim: int) -> str:
    names = mesh.mesh_dim_names
    return f"mesh dimension {dim}" + (f" ({names[dim]!r})" if names else "")


def _is_shard(placement: Any) -> bool:
    # _StridedShard derives from Shard in some torch versions; it is not a plain split.
    return type(placement) is Shard


def _placements(value: torch.Tensor, mesh: DeviceMesh) -> tuple[Any, ...]:
    if isinstance(value, DTensor):
        return tuple(value.placements)
    return (Replicate(),) * mesh.ndim


def _split_as(value: torch.Tensor, mesh: DeviceMesh) -> str:
    if isinstance(value, DTensor):
        return f"a DTensor with placements {tuple(value.placements)!r}"
    return f"a plain tensor (replicated: {_placements(value, mesh)!r})"


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one call lies on ``mesh``.

    ``vocab_dim``: the mesh dimension that splits the heads along the vocabulary (or
    ``None``); ``row_dims``: mesh dimension → the input dimension it splits;
    ``batch_ndim``: the input's batch dimensions (all but the features).
    """

    mesh: DeviceMesh
    vocab_dim: int | None
    row_dims: dict[int, int]
    batch_ndim: int

    def row_placements(self) -> tuple[Any, ...]:
        """The placements of a per-token tensor on this rank: its rows split like the input's."""
        return tuple(
            Shard(self.row_dims[d]) if d in self.row_dims else Replicate()
            for d in range(self.mesh.ndim)
        )

    def head_grad_placements(self, placements: tuple[Any, ...]) -> tuple[Any, ...]:
        """A head's gradient: a partial sum over the dimensions that split the rows."""
        return tuple(Partial() if d in self.row_dims else p for d, p in enumerate(placements))

    def groups(self) -> list[dist.ProcessGroup]:
        return [self.mesh.get_group(d) for d in sorted(self.row_dims)]


def _fail(name: str, message: str) -> NoReturn:
    raise ValueError(f"{name}: {message}")


def _common_mesh(name: str, tensors: dict[str, torch.Tensor]) -> DeviceMesh:
    meshes = {
        arg: value.device_mesh for arg, value in tensors.items() if isinstance(value, DTensor)
    }
    first_arg, mesh = next(iter(meshes.items()))
    for arg, other in meshes.items():
        if other != mesh:
            _fail(
                name,
                f"every DTensor argument must live on one device mesh, but {first_arg} is on "
                f"{mesh} and {arg} on {other}",
            )
    return mesh


def _check_devices(name: str, mesh: DeviceMesh, tensors: dict[str, torch.Tensor]) -> None:
    for arg, value in tensors.items():
        if value.device.type != mesh.device_type:
            _fail(
                name,
                f"the device mesh is a {mesh.device_type!r} mesh but {arg} is on "
                f"{value.device}; build the mesh for the tensors' device "
                f"(init_device_mesh({value.device.type!r}, ...)) or move the tensors to "
                f"{mesh.device_type!r}",
            )


def _check_placement_kinds(name: str, mesh: DeviceMesh, tensors: dict[str, torch.Tensor]) -> None:
    """Only ``Shard`` and ``Replicate`` have a meaning for a loss argument."""
    for arg, value in tensors.items():
        if not isinstance(value, DTensor):
            continue
        for d, placement in enumerate(value.placements):
            if placement.is_partial():
                _fail(
                    name,
                    f"{arg} has placement {placement!r} on {_mesh_dim(mesh, d)}, a "
                    "pending reduction, which is not supported; redistribute it to "
                    "Replicate() or a Shard first",
                )
            if not (_is_shard(placement) or placement.is_replicate()):
                _fail(
                    name,
                    f"{arg} has placement {placement!r} on {_mesh_dim(mesh, d)}, "
                    "which is not supported; supported are Shard(dim) and Replicate()",
                )


def _vocab_dim(
    name: str, mesh: DeviceMesh, roles: _Roles, arguments: Mapping[str, Any]
) -> int | None:
    """The mesh dimension that splits the heads along the vocabulary, if any."""
    present = {arg: arguments[arg] for arg in roles.heads if arguments.get(arg) is not None}
    if not present:
        return None
    first_arg, first = next(iter(present.items()))
    placements = _placements(first, mesh)
    for arg, value in present.items():
        if _placements(value, mesh) != placements:
            _fail(
                name,
                f"{arg} is {_split_as(value, mesh)} but {first_arg} is "
                f"{_split_as(first, mesh)}; the head's tensors must be split the same way "
                "(a plain tensor counts as replicated)",
            )
    vocab_dims = []
    for d, placement in enumerate(placements):
        if _is_shard(placement) and placement.dim % first.dim() == 0:
            vocab_dims.append(d)
        elif not placement.is_replicate():
            _fail(
                name,
                f"{first_arg} has placement {placement!r} on {_mesh_dim(mesh, d)}, "
                "which is not supported; a head may be Shard(0) (split along the "
                "vocabulary) or Replicate()",
            )
    if len(vocab_dims) > 1:
        _fail(
            name,
            f"{first_arg} is split along the vocabulary over mesh dimensions {vocab_dims}; "
            "at most one mesh dimension may split it (placements "
            f"{placements})",
        )
    return vocab_dims[0] if vocab_dims else None


def _mesh_layout(
    name: str, mesh: DeviceMesh, roles: _Roles, arguments: Mapping[str, Any]
) -> _Layout:
    vocab_dim = _vocab_dim(name, mesh, roles, arguments)
    input_arg = roles.rows[0]
    value = arguments[input_arg]
    batch_ndim = value.dim() - 1
    row_dims = {}
    for d, placement in enumerate(_placements(value, mesh)):
        if placement.is_replicate():
            continue
        split = placement.dim % value.dim()
        if split >= batch_ndim:
            _fail(
                name,
                f"{input_arg} has placement {placement!r} on {_mesh_dim(mesh, d)}: "
                f"it is split along its features (dimension {split} of "
                f"{tuple(value.shape)}), which is not supported; split a batch or sequence "
                f"dimension (0..{batch_ndim - 1}) or replicate it",
            )
        if d != vocab_dim:
            row_dims[d] = split
    if roles.whole_sequences is not None and row_dims:
        _check_whole_sequences(name, mesh, roles, arguments, row_dims, batch_ndim)
    return _Layout(mesh, vocab_dim, row_dims, batch_ndim)


def _check_whole_sequences(
    name: str,
    mesh: DeviceMesh,
    roles: _Roles,
    arguments: Mapping[str, Any],
    row_dims: dict[int, int],
    batch_ndim: int,
) -> None:
    """A function of whole sequences: the rows may be split only by whole sequences, i.e.
    along the batch dimension of a padded ``(B, T, ...)`` input."""
    input_arg = roles.rows[0]
    shape = tuple(arguments[input_arg].shape)
    packed = [arg for arg in roles.whole_sequences or () if arguments.get(arg) is not None]
    for d, split in row_dims.items():
        if batch_ndim < 2 or split != 0:
            _fail(
                name,
                f"{input_arg} of shape {shape} is split along dimension {split} on "
                f"{_mesh_dim(mesh, d)}, which cuts its sequences across ranks; a sequence "
                "loss needs each sequence whole on one rank: split the batch dimension of a "
                f"padded (B, T, {shape[-1]}) input, or gather the sequence dimension first "
                "(redistribute it to Replicate())",
            )
        if packed:
            _fail(
                name,
                f"{input_arg} is split on {_mesh_dim(mesh, d)} while {', '.join(packed)} lays "
                "out packed sequences, which a split could cut; split a padded batch (one "
                "sequence per row), or replicate the input",
            )


# ----------------------------------------------------------------------------- to this rank


def _vocab_slice(
    name: str, mesh: DeviceMesh, vocab_dim: int, head: Any, arg: str
) -> tuple[int, int]:
    """``(vocab_start, num_classes)`` of this rank's rows of a ``Shard(0)`` head: torch's
    split (``torch.chunk``: ``⌈V/n⌉`` rows per rank, the last ranks fewer)."""
    classes, ranks = head.shape[0], mesh.size(vocab_dim)
    rank = mesh.get_local_rank(vocab_dim)
    per_rank = -(-classes // ranks)
    # Decided from the global shape alone, so every rank raises, not only the empty ones.
    empty = [r for r in range(ranks) if r * per_rank >= classes]
    if empty:
        _fail(
            name,
            f"{arg} of {classes} classes split over the {ranks} ranks of "
            f"{_mesh_dim(mesh, vocab_dim)} leaves ranks {empty} without a class "
            f"({per_rank} per rank); vocab-parallel needs at least one class on every rank: "
            "use fewer ranks for the vocabulary or pad it",
        )
    start = rank * per_rank
    size = min(per_rank, classes - start)
    local = head.to_local().shape[0]
    if local != size:
        _fail(
            name,
            f"{arg}'s local shard holds {local} classes, but a Shard(0) split of {classes} "
            f"classes over {ranks} ranks gives rank {rank} {size}; build it with "
            "distribute_tensor (or from_local with torch.chunk's split)",
        )
    return start, classes


def _to_rows(value: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """This rank's rows of a per-token argument (differentiable for the input)."""
    wanted = layout.row_placements()
    mesh = layout.mesh
    if not isinstance(value, DTensor):
        if all(p.is_replicate() for p in wanted) or value.dim() == 0:
            return value  # a 0-d side input is one value for every row
        value = DTensor.from_local(value, mesh, (Replicate(),) * mesh.ndim, run_check=False)
    if tuple(value.placements) != wanted:
        value = value.redistribute(mesh, wanted)
    return value.to_local()


def _full_tensor(value: torch.Tensor | None) -> torch.Tensor | None:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _shift_before_split(
    arguments: dict[str, Any], layout: _Layout, input_arg: str
) -> dict[str, Any]:
    """Shift the labels on the whole sequence when the sequence itself is split: the last
    position of one rank's rows is scored against the first label of the next rank's."""
    shift, target = arguments.get("shift"), arguments.get("target")
    sequence = layout.batch_ndim - 1
    splits_sequence = sequence in layout.row_dims.values()
    if not shift or not splits_sequence or not isinstance(target, torch.Tensor):
        return arguments
    if isinstance(shift, bool):
        shift = int(shift)
    batch = tuple(arguments[input_arg].shape[: layout.batch_ndim])
    if not isinstance(shift, int) or shift < 0 or target.is_floating_point():
        return arguments  # the function's own checks say what is wrong
    if tuple(target.shape) != batch:
        return arguments
    ignore_index = arguments.get("ignore_index")
    ignore_index = DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        return arguments
    whole_target = target.full_tensor() if isinstance(target, DTensor) else target
    return {
        **arguments,
        "target": shifted_target(whole_target, shift, ignore_index),
        "shift": 0,
    }


# ----------------------------------------------------------------------------- the call


class _SumOverRanks(torch.autograd.Function):
    """Sum ``values`` over the process groups; every rank's share enters with weight 1, so
    the gradient of each share is the (replicated) upstream gradient itself."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, groups: list[dist.ProcessGroup]) -> torch.Tensor:
        total = values.clone()
        for group in groups:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _outputs(result: Any) -> list[Any]:
    if isinstance(result, torch.Tensor):
        return [result]
    return list(result)


def _rebuild(result: Any, values: list[Any]) -> Any:
    if isinstance(result, torch.Tensor):
        return values[0]
    return type(result)(*values)


def _reduce_scalars(
    outputs: list[Any], layout: _Layout, denominator: torch.Tensor | None
) -> list[Any]:
    """Sum the scalar outputs over the ranks that split the rows (one all_reduce per such
    mesh dimension, the denominator of a "mean" riding along) and divide by it."""
    scalars = [
        i for i, out in enumerate(outputs) if isinstance(out, torch.Tensor) and out.dim() == 0
    ]
    if not scalars or not layout.row_dims:
        return outputs
    shares = [outputs[i].to(torch.float64) for i in scalars]
    if denominator is not None:
        shares.append(denominator.detach().to(torch.float64))
    totals = _SumOverRanks.apply(torch.stack(shares), layout.groups())
    reduced = list(outputs)
    for k, i in enumerate(scalars):
        total = totals[k]
        if denominator is not None:
            count = totals[-1]
            # Every row ignored everywhere: NaN, with zero gradients (as the local "mean").
            inverse = torch.where(count > 0, 1.0 / count, 0.0).detach()
            total = torch.where(count > 0, total * inverse, torch.nan)
        reduced[i] = total.to(outputs[i].dtype)
    return reduced


def _to_dtensor(value: torch.Tensor, layout: _Layout, input_shape: tuple[int, ...]) -> Any:
    mesh = layout.mesh
    if value.dim() == 0 or not layout.row_dims:
        return DTensor.from_local(value, mesh, (Replicate(),) * mesh.ndim, run_check=False)
    shape = list(value.shape)
    for split in layout.row_dims.values():
        shape[split] = input_shape[split]
    stride = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    return DTensor.from_local(
        value,
        mesh,
        layout.row_placements(),
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(stride),
    )


def _vocab_parallel(
    name: str, roles: _Roles, arguments: Mapping[str, Any], layout: _Layout
) -> VocabParallel | None:
    """Where this rank's shard of a head split along the vocabulary lies (``None``: the
    head is whole on every rank)."""
    if layout.vocab_dim is None:
        return None
    mesh = layout.mesh
    head_arg = next(arg for arg in roles.heads if isinstance(arguments.get(arg), DTensor))
    if not roles.vocab_parallel:
        _fail(
            name,
            f"{head_arg} is split along the vocabulary (Shard(0) on "
            f"{_mesh_dim(mesh, layout.vocab_dim)}), which {name} does not support; replicate it",
        )
    vocab_start, num_classes = _vocab_slice(
        name, mesh, layout.vocab_dim, arguments[head_arg], head_arg
    )
    return VocabParallel(mesh.get_group(layout.vocab_dim), vocab_start, num_classes)


def _local_arguments(
    arguments: Mapping[str, Any],
    roles: _Roles,
    layout: _Layout,
    keywords_name: str | None,
    per_token: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """The call's arguments on this rank: its rows, whole class weights, its head shard."""
    local = dict(_shift_before_split(arguments, layout, roles.rows[0]))
    for arg in roles.rows:
        if isinstance(local.get(arg), torch.Tensor):
            local[arg] = _to_rows(local[arg], layout)
    if per_token:
        local[keywords_name] = {k: _to_rows(v, layout) for k, v in per_token.items()}
    for arg in roles.whole:
        local[arg] = _full_tensor(local.get(arg))
    for arg in roles.heads:
        head = local.get(arg)
        if isinstance(head, DTensor):
            local[arg] = head.to_local(
                grad_placements=layout.head_grad_placements(tuple(head.placements))
            )
    return local


def _on_mesh(
    function: Callable[..., Any],
    signature: inspect.Signature,
    roles: _Roles,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    name = function.__name__
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    keywords_name = next(
        (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
    )
    keywords = arguments.get(keywords_name, {})
    per_token = dict(keywords) if roles.per_token_keywords else {}
    known = {*roles.rows, *roles.heads, *roles.whole, *per_token}
    stray = [
        arg
        for arg, value in {**arguments, **keywords}.items()
        if isinstance(value, DTensor) and arg not in known
    ]
    if stray:
        _fail(name, f"{', '.join(stray)} cannot be a DTensor; pass a plain tensor")
    if arguments.get("vocab_parallel") is not None:
        _fail(
            name,
            "vocab_parallel is given with DTensor arguments, whose placements say how the "
            "vocabulary is split; pass vocab_parallel=None, or plain tensors (the head's "
            "local shard, .to_local()) with vocab_parallel",
        )
    input_arg = roles.rows[0]
    if not isinstance(arguments.get(input_arg), torch.Tensor):
        return function(*args, **kwargs)  # the function's own check names the mistake

    # Every check runs before the first collective, so a bad call fails on every rank alike.
    tensors = {
        arg: value
        for arg, value in {**arguments, **per_token}.items()
        if arg in known and isinstance(value, torch.Tensor)
    }
    mesh = _common_mesh(name, tensors)
    _check_devices(name, mesh, tensors)
    _check_placement_kinds(name, mesh, tensors)
    layout = _mesh_layout(name, mesh, roles, arguments)
    vocab = _vocab_parallel(name, roles, arguments, layout)

    local = _local_arguments(arguments, roles, layout, keywords_name, per_token)
    denominator = None
    if roles.mean is not None and layout.row_dims and local.get("reduction") == "mean":
        denominator = roles.mean(local, None if vocab is None else vocab.num_classes)
        local["reduction"] = "sum"
    if vocab is not None:
        local["vocab_parallel"] = vocab
    bound.arguments.update(local)
    result = function(*bound.args, **bound.kwargs)
    outputs = _reduce_scalars(_outputs(result), layout, denominator)
    input_shape = tuple(arguments[input_arg].shape)
    return _rebuild(
        result,
        # A non-tensor output (a dict of logged metrics) stays this rank's.
        [
            _to_dtensor(out, layout, input_shape) if isinstance(out, torch.Tensor) else out
            for out in outputs
        ],
    )
