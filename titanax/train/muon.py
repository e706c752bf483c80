"""Muon (momentum orthogonalised by Newton-Schulz) on the params as each device holds them.

Muon replaces each weight matrix's update by the nearest semi-orthogonal matrix to its
(Nesterov) momentum, found by a few Newton-Schulz iterations; everything that is not a matrix
(embeddings, the output head, norms, biases) is trained by AdamW beside it (Keller Jordan's
modded-nanogpt; Moonshot's "Muon is scalable"). The arithmetic is ``optax.contrib.muon``'s:
Nesterov momentum with bias correction, the Frobenius normalisation, the quintic iteration
(3.4445, -4.7750, 2.0315), the width scale ``sqrt(max(1, fan_out / fan_in))`` -- or
Moonshot's ``consistent_rms`` -- then decoupled weight decay and the learning rate.

What a matrix is comes from its layer: a param's ``ParameterSpec.fan_axes`` name its fan-in and
fan-out dimensions (a query projection ``[D, H, Dh]`` is the ``D x (H * Dh)`` matrix), every
other dimension is a batch of matrices orthogonalised one by one (the stacked layers of a
``Repeat``, a mixture's experts, the gate and up halves of a fused MLP).

Newton-Schulz needs whole matrices, and the update runs in local view on what each device
holds (``state_sharding.py``). Where a layout splits a matrix dimension (TP's heads, FSDP's or
ZeRO's split of a fan dimension), the momentum is gathered whole over those mesh axes; a split
of a batch dimension (a pipeline's stages, an expert axis) needs no gather. Then every device
that holds the same whole matrices (a *team*: the mesh axes that split none of the param's
batch dimensions) would iterate the same ones, so each matrix is given to one member, the
members' loads balanced over all the team's matrices whatever their shape
(``muon_owners.py``): each member runs only its own matrices' iterations (a ``lax.switch``
on its position) and one all-gather over the team brings every result back, each device
keeping its own part. No collective runs inside the iterations, and a device's FLOPs are its
share and a little (``--explain`` prints each matrix's owner and how much).
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import optax
from optax.transforms import _masking

from titanax import errors
from titanax.parallel import collectives
from titanax.train import muon_owners
from titanax.train.param_layouts import ParamLayout

# The quintic iteration's coefficients (Keller Jordan's; optax's default).
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# The params Muon trains by default: every weight with fan-in and fan-out dimensions...
DEFAULT_MATRICES = (r"weight$",)
# ... but the embeddings and the output heads, which AdamW trains (the Muon papers' choice), and
# a mixture's router (a few columns, one per expert: AdamW's, as the Muon MoE recipes keep it).
DEFAULT_NOT_MATRICES = (r"(^|/)(token_emb|pos_emb|lm_head|head|router)/",)


def matrix_labels(layouts: Any, *, matrices: Sequence[str], not_matrices: Sequence[str]) -> Any:
    """'muon' or 'adam' per param; refused by name where a pattern of the user's matches a param
    that is not a matrix, or where no param is Muon's."""
    chosen = [re.compile(p) for p in matrices]
    excluded = [re.compile(p) for p in not_matrices]
    user_patterns = tuple(matrices) != DEFAULT_MATRICES
    any_matrix = []

    def label(layout: ParamLayout) -> str:
        if not any(p.search(layout.path) for p in chosen) or \
                any(p.search(layout.path) for p in excluded):
            return "adam"
        if not layout.is_matrix:
            if user_patterns:
                raise errors.ConfigError(
                    f"{layout.path} (shape {layout.shape}) matches a Muon pattern but is not a "
                    "matrix: its layer names no fan-in and fan-out dimensions",
                    path="learner.optimizer.matrices",
                    suggestion="narrow the pattern to weights (or add the path to "
                               "learner.optimizer.not_matrices); AdamW trains the rest")
            return "adam"
        any_matrix.append(layout.path)
        return "muon"

    labels = jax.tree_util.tree_map(label, layouts,
                                    is_leaf=lambda x: isinstance(x, ParamLayout))
    if not any_matrix:
        raise errors.ConfigError(
            f"no param of the model is a matrix matched by {list(matrices)} and not by "
            f"{list(not_matrices)}: Muon would train nothing", path="learner.optimizer.matrices",
            suggestion="match the model's weight paths (--print_config's model, or --explain with "
                       "optimizer adamw, lists them; under LoRA the trained ones end in _lora_a "
                       "and _lora_b), or use adamw")
    return labels


def newton_schulz(x: jax.Array, *, steps: int, eps: float) -> jax.Array:
    """The quintic Newton-Schulz iteration on a batch of matrices ``[B, M, N]``: each scaled by
    its Frobenius norm, the wide orientation iterated (a tall matrix transposed there and
    back)."""
    tall = x.shape[1] > x.shape[2]
    if tall:
        x = jnp.swapaxes(x, 1, 2)
    x = x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=(1, 2), keepdims=True)) + eps)
    a, b, c = (jnp.asarray(value, x.dtype) for value in NEWTON_SCHULZ_COEFFICIENTS)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, 1, 2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return jnp.swapaxes(x, 1, 2) if tall else x


def _wide(layout: ParamLayout) -> bool:
    """Whether the param's matrices are iterated as they are (fan-in <= fan-out), not
    transposed."""
    return _fan(layout, layout.fan_in) <= _fan(layout, layout.fan_out)


def _fan(layout: ParamLayout, dims: Sequence[int]) -> int:
    return math.prod(layout.shape[d] for d in dims)


def _order(layout: ParamLayout) -> Tuple[int, ...]:
    """The param's dimensions as batch, fan-in, fan-out."""
    matrix_dims = layout.fan_in + layout.fan_out
    return tuple(d for d in range(len(layout.shape)) if d not in matrix_dims) + matrix_dims


def whole_matrices(x: jax.Array, layout: ParamLayout) -> jax.Array:
    """This device's part of one matrix param as whole matrices ``[B, m, n]`` in their wide
    orientation (``m <= n``): its fan dimensions gathered over the axes that split them."""
    for dim in layout.fan_in + layout.fan_out:
        if layout.split[dim]:
            x = collectives.all_gather(x, layout.split[dim], axis_index=dim, invariant=True)
    moved = jnp.transpose(x, _order(layout))
    batch = len(layout.shape) - len(layout.fan_in) - len(layout.fan_out)
    flat = moved.reshape((math.prod(moved.shape[:batch]), _fan(layout, layout.fan_in),
                          _fan(layout, layout.fan_out)))
    return flat if _wide(layout) else jnp.swapaxes(flat, 1, 2)


def to_part(y: jax.Array, layout: ParamLayout, part_shape: Tuple[int, ...]) -> jax.Array:
    """``whole_matrices``' inverse on its result: the param's layout again, this device's part
    of its fan dimensions kept."""
    order = _order(layout)
    whole = tuple(layout.shape[d] if d in layout.fan_in + layout.fan_out else part_shape[d]
                  for d in range(len(layout.shape)))
    y = y if _wide(layout) else jnp.swapaxes(y, 1, 2)
    y = jnp.transpose(y.reshape(tuple(whole[d] for d in order)),
                      tuple(sorted(range(len(order)), key=lambda i: order[i])))
    for dim in layout.fan_in + layout.fan_out:
        if layout.split[dim]:
            size = part_shape[dim]
            y = jax.lax.dynamic_slice_in_dim(
                y, collectives.axis_index(layout.split[dim]) * size, size, axis=dim)
    return y


def orthogonalize(parts: List[jax.Array], layouts: List[ParamLayout], *, steps: int,
                  eps: float) -> List[jax.Array]:
    """The Newton-Schulz images of the matrix params' parts this device holds: each whole
    matrix iterated by one device of those that hold it alike (``muon_owners.teams``), the
    results gathered back -- no collective inside the iterations."""
    wholes = [whole_matrices(x, layout) for x, layout in zip(parts, layouts)]
    images: Dict[muon_owners.Matrix, jax.Array] = {}
    for team in muon_owners.teams(layouts, keys=[w.dtype for w in wholes]):
        images.update(_team_images(team, wholes, steps=steps, eps=eps))
    return [to_part(jnp.stack([images[(i, j)] for j in range(whole.shape[0])]), layouts[i],
                    parts[i].shape) for i, whole in enumerate(wholes)]


def _iterated(matrices: Sequence[muon_owners.Matrix], wholes: Sequence[jax.Array], *,
              steps: int, eps: float) -> List[jax.Array]:
    """Newton-Schulz on ``matrices``, batched by shape, flattened in their order."""
    by_shape: Dict[Tuple[int, ...], List[muon_owners.Matrix]] = {}
    for i, j in matrices:
        by_shape.setdefault(wholes[i].shape[1:], []).append((i, j))
    done = {}
    for members in by_shape.values():
        stack = jnp.stack([wholes[i][j] for i, j in members])
        done.update(zip(members, newton_schulz(stack, steps=steps, eps=eps)))
    return [done[m].reshape(-1) for m in matrices]


def _team_images(team: muon_owners.Team, wholes: Sequence[jax.Array], *, steps: int,
                 eps: float) -> Dict[muon_owners.Matrix, jax.Array]:
    """Each of the team's matrices orthogonalised by its owner: every member runs its own
    branch (``lax.switch`` on its position: only its matrices' FLOPs), writes them into one
    buffer padded to the longest member's, and an all-gather hands every member all of them."""
    if team.count == 1:
        (mine,) = team.work
        return dict(zip(mine, (flat.reshape(team.shapes[m]) for m, flat in
                               zip(mine, _iterated(mine, wholes, steps=steps, eps=eps)))))
    length = max(sum(math.prod(team.shapes[m]) for m in mine) for mine in team.work)
    dtype = wholes[team.work[0][0][0]].dtype

    def branch(member: int):
        def run(operands):
            flat = _iterated(team.work[member], operands, steps=steps, eps=eps)
            buffer = jnp.concatenate(flat) if flat else jnp.zeros((0,), dtype)
            return jnp.pad(buffer, (0, length - buffer.shape[0]))
        return run

    mine = jax.lax.switch(collectives.axis_index(team.axes),
                          [branch(member) for member in range(team.count)], list(wholes))
    every = collectives.all_gather(mine, team.axes, invariant=True)  # [members, length]
    images = {}
    for member, matrices in enumerate(team.work):
        start = 0
        for m in matrices:
            size = math.prod(team.shapes[m])
            images[m] = every[member, start:start + size].reshape(team.shapes[m])
            start += size
    return images


def width_scale(layout: ParamLayout, consistent_rms: Optional[float]) -> float:
    """The update's scale from the whole matrix's shape: ``sqrt(max(1, fan_out / fan_in))``, or
    with ``consistent_rms`` ``sqrt(max(fan_in, fan_out)) * consistent_rms`` (an update of that
    RMS, AdamW's typical one: Moonshot's rule, to share AdamW's learning rate)."""
    fan_in, fan_out = _fan(layout, layout.fan_in), _fan(layout, layout.fan_out)
    if consistent_rms is not None:
        return math.sqrt(max(fan_in, fan_out)) * consistent_rms
    return math.sqrt(max(1.0, fan_out / fan_in))


def masked(tree: Any, labels: Any, *, keep: str) -> Any:
    """``tree`` (one entry per param) with optax's MaskedNode where a param's label is not
    ``keep``: the tree one part of ``optax.partition`` sees."""
    return jax.tree_util.tree_map(
        lambda entry, label: entry if label == keep else _masking.MaskedNode(),
        tree, labels, is_leaf=lambda x: isinstance(x, ParamLayout))


def scale_by_muon(layouts: Any, *, beta: float, steps: int, eps: float, nesterov: bool,
                  consistent_rms: Optional[float]) -> optax.GradientTransformation:
    """Muon's scaling of the matrices' gradients (``layouts``: theirs, MaskedNode elsewhere);
    its state is optax's ``(count, mu)`` of ``scale_by_muon``."""
    is_layout = lambda x: isinstance(x, (ParamLayout, _masking.MaskedNode))  # noqa: E731

    def init(params):
        return optax.contrib.MuonState(
            count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
            ns_coeffs=jnp.asarray(NEWTON_SCHULZ_COEFFICIENTS))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree_util.tree_map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        flat_layouts, treedef = jax.tree_util.tree_flatten(layouts, is_leaf=is_layout)
        flat_mu = treedef.flatten_up_to(mu_hat)
        matrices = [i for i, layout in enumerate(flat_layouts)
                    if isinstance(layout, ParamLayout)]
        images = orthogonalize([flat_mu[i] for i in matrices],
                               [flat_layouts[i] for i in matrices], steps=steps, eps=eps)
        for i, image in zip(matrices, images):
            flat_mu[i] = (image * width_scale(flat_layouts[i], consistent_rms)).astype(
                flat_mu[i].dtype)
        scaled = jax.tree_util.tree_unflatten(treedef, flat_mu)
        return scaled, optax.contrib.MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init, update)


def describe(*, param_layouts: Any, labels: Any, ns_steps: int = 5, device_count: int = 1,
             **_) -> str:
    """``--explain``'s lines: which params Muon trains, each as its batch of fan-in x fan-out
    matrices, the mesh axes its parts are gathered over, the team of devices that hold its
    matrices alike and which member iterates each, and the Newton-Schulz FLOPs a device runs
    per step against its 1/``device_count`` share of all of them. ``labels``:
    ``matrix_labels``' answer."""
    pairs = list(zip(jax.tree_util.tree_leaves(param_layouts,
                                               is_leaf=lambda x: isinstance(x, ParamLayout)),
                     jax.tree_util.tree_leaves(labels)))
    chosen = [layout for layout, label in pairs if label == "muon"]
    teams = muon_owners.teams(chosen)
    owner_of = {m: (team, team.owner(m)) for team in teams for m in team.shapes}
    rows, total = [], 0
    for i, layout in enumerate(chosen):
        fan_in, fan_out = muon_owners.fans(layout)
        count = math.prod(layout.shape[d] for d in range(len(layout.shape))
                          if d not in layout.fan_in + layout.fan_out)
        total += count * muon_owners.newton_schulz_flops(fan_in, fan_out, steps=ns_steps)
        gathers = ", ".join(f"dim {d} over {'x'.join(layout.split[d])}"
                            for d in layout.fan_in + layout.fan_out if layout.split[d]) or "-"
        mine = [owner_of[(i, j)] for j in range(muon_owners.local_matrices(layout))]
        team = mine[0][0]
        rows.append(f"  {layout.path:44s} {count:>4d} x {fan_in:>5d} x {fan_out:<6d} "
                    f"{gathers:18s} {'x'.join(team.axes) or '-':12s} "
                    f"{' '.join(str(member) for _, member in mine)}")
    # (A device is a member of every team; at most the most loaded member's FLOPs of each.)
    own = sum(max(team.load(d, steps=ns_steps) for d in range(team.count)) for team in teams)
    share = total / max(device_count, 1)
    return "\n".join([
        f"optimizer: Muon on {len(rows)} params ({ns_steps} Newton-Schulz steps), AdamW on "
        f"{sum(label == 'adam' for _, label in pairs)}",
        f"  {'param':44s} matrices (batch x fan-in x fan-out), gathered whole, team "
        "(devices along), each matrix's owner (position along the team's axes)",
        *rows,
        f"  Newton-Schulz per device and step: {own / 1e9:.3g} GFLOP, {own / share:.2f}x its "
        f"1/{device_count} share of {total / 1e9:.3g} GFLOP (each matrix iterated by one "
        "owner, the owners' loads balanced; the results all-gathered over the team)"])
