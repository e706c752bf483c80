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
holds (``state_sharding.py``): where a layout splits a matrix's fan dimensions (TP's heads,
FSDP's or ZeRO's split) each device holds a block of every matrix, and devices along the other
axes (data-parallel replicas) hold the same blocks again; a split of a batch dimension (a
pipeline's stages, an expert axis) just means fewer matrices. Each matrix is iterated whole by
one device of those (its *team*), the owners' loads balanced over all the team's matrices
(``muon_owners.py``): an all-to-all over the splitting axes brings each owner the blocks of its
matrices, each owner runs only its own matrices' iterations (a ``lax.switch`` on its position),
the reverse all-to-all returns each device its blocks of the results, and an all-gather over the
replica axes brings every replica's. No collective runs inside the iterations; a device's FLOPs
are its share and a little, and no device assembles more matrices whole than its own
(``--explain`` prints each matrix's owner and the FLOPs).
"""

from __future__ import annotations

import functools
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


def _inverse(permutation: Sequence[int]) -> Tuple[int, ...]:
    return tuple(sorted(range(len(permutation)), key=lambda i: permutation[i]))


def _blocks(x: jax.Array, layout: ParamLayout) -> jax.Array:
    """This device's part of a matrix param as ``[matrices, *its block of the fan dims]``
    (the batch dimensions first and flattened, the fan dimensions in the param's order)."""
    batch = muon_owners.batch_dims(layout)
    moved = jnp.transpose(x, batch + muon_owners.fan_dims(layout))
    return moved.reshape((math.prod(moved.shape[:len(batch)]),) + moved.shape[len(batch):])


def _from_blocks(y: jax.Array, layout: ParamLayout, part_shape: Tuple[int, ...]) -> jax.Array:
    """``_blocks``' inverse: the param's own layout of this device's part."""
    order = muon_owners.batch_dims(layout) + muon_owners.fan_dims(layout)
    return jnp.transpose(y.reshape(tuple(part_shape[d] for d in order)), _inverse(order))


def _as_matrix(whole: jax.Array, layout: ParamLayout) -> jax.Array:
    """A whole matrix (its fan dims in the param's order) as ``[m, n]``, wide (``m <= n``)."""
    fans = muon_owners.fan_dims(layout)
    moved = jnp.transpose(whole, [fans.index(d) for d in layout.fan_in + layout.fan_out])
    matrix = moved.reshape(muon_owners.fans(layout))
    return matrix if matrix.shape[0] <= matrix.shape[1] else matrix.T


def _from_matrix(matrix: jax.Array, layout: ParamLayout) -> jax.Array:
    """``_as_matrix``' inverse."""
    fan_in, fan_out = muon_owners.fans(layout)
    matrix = matrix if fan_in <= fan_out else matrix.T
    fans = muon_owners.fan_dims(layout)
    order = [fans.index(d) for d in layout.fan_in + layout.fan_out]
    return jnp.transpose(matrix.reshape([layout.shape[d] for d in layout.fan_in
                                         + layout.fan_out]), _inverse(order))


def _block_slices(layout: ParamLayout, team: muon_owners.Team, split_position: int
                  ) -> Tuple[slice, ...]:
    """Where the block held at ``split_position`` along the team's split axes sits in a whole
    matrix (its fan dims in the param's order)."""
    sizes = dict(layout.mesh)
    coordinates, rest = {}, split_position
    for axis in reversed(team.split_axes):
        rest, coordinates[axis] = divmod(rest, sizes[axis])
    slices = []
    for d in muon_owners.fan_dims(layout):
        index = 0
        for axis in layout.split[d]:
            index = index * sizes[axis] + coordinates[axis]
        length = layout.shape[d] // layout.parts[d]
        slices.append(slice(index * length, (index + 1) * length))
    return tuple(slices)


def orthogonalize(parts: List[jax.Array], layouts: List[ParamLayout], *, steps: int,
                  eps: float) -> List[jax.Array]:
    """The Newton-Schulz images of the matrix params' parts this device holds: each matrix
    iterated whole by one member of its team (``muon_owners.py``), its blocks sent there and
    the image's blocks sent back -- no collective inside the iterations."""
    blocks = [_blocks(x, layout) for x, layout in zip(parts, layouts)]
    images: Dict[muon_owners.Matrix, jax.Array] = {}
    for team in muon_owners.teams(layouts):
        images.update(_TeamExchange(team, layouts, blocks).images(steps=steps, eps=eps))
    return [_from_blocks(jnp.stack([images[(i, j)] for j in range(block.shape[0])]),
                         layouts[i], parts[i].shape).astype(parts[i].dtype)
            for i, block in enumerate(blocks)]


class _TeamExchange:
    """One team's matrices: their blocks to their owners, Newton-Schulz there, the images'
    blocks back. Rows of the exchanged buffers are padded to the longest member's blocks."""

    def __init__(self, team: muon_owners.Team, layouts: Sequence[ParamLayout],
                 blocks: Sequence[jax.Array]):
        self.team, self.layouts = team, layouts
        # (The exchanged rows hold every member's blocks: one dtype for the team's params.)
        self.dtype = jnp.result_type(*{blocks[i].dtype for i, _ in team.shapes})
        mine = {i for i, _ in team.shapes}
        self.blocks = [b.astype(self.dtype) if i in mine else b for i, b in enumerate(blocks)]
        self.block_size = {i: math.prod(blocks[i].shape[1:]) for i, _ in team.shapes}
        self.length = max(sum(self.block_size[i] for i, _ in mine) for mine in team.work)

    def _row(self, pieces: List[jax.Array]) -> jax.Array:
        row = jnp.concatenate(pieces) if pieces else jnp.zeros((0,), self.dtype)
        return jnp.pad(row, (0, self.length - row.shape[0]))

    @staticmethod
    def _switch(axes: Tuple[str, ...], branches: List[Any], operand: Any) -> jax.Array:
        if len(branches) == 1:
            return branches[0](operand)
        return jax.lax.switch(collectives.axis_index(axes), branches, operand)

    def images(self, *, steps: int, eps: float) -> Dict[muon_owners.Matrix, jax.Array]:
        team = self.team
        # 1. Each device's blocks of the matrices of each member of its replica, one row per
        # member: to the owners (received[s]: the blocks held at split position s).
        outgoing = self._switch(team.replica_axes, [
            functools.partial(self._outgoing, replica) for replica in range(team.replicas)],
            self.blocks)
        received = outgoing if team.splits == 1 else collectives.all_to_all(
            outgoing, team.split_axes, split_dimension=0, concat_dimension=0)
        # 2. Each member iterates its own matrices (only its branch runs), and cuts each image
        # into the blocks of the members of its replica.
        results = self._switch(team.replica_axes + team.split_axes, [
            functools.partial(self._iterate, member, steps=steps, eps=eps)
            for member in range(team.count)], received)
        # 3. Back to the devices whose blocks they are; then every replica's results.
        back = results if team.splits == 1 else collectives.all_to_all(
            results, team.split_axes, split_dimension=0, concat_dimension=0)
        every = back[None] if not team.replica_axes else collectives.all_gather(
            back, team.replica_axes, invariant=True)
        images = {}
        for member, matrices in enumerate(team.work):
            replica, split = divmod(member, team.splits)
            start = 0
            for i, j in matrices:
                size = self.block_size[i]
                images[(i, j)] = every[replica, split, start:start + size].reshape(
                    self.blocks[i].shape[1:])
                start += size
        return images

    def _outgoing(self, replica: int, blocks: Sequence[jax.Array]) -> jax.Array:
        team = self.team
        return jnp.stack([self._row([blocks[i][j].reshape(-1)
                                     for i, j in team.work[replica * team.splits + split]])
                          for split in range(team.splits)])

    def _iterate(self, member: int, received: jax.Array, *, steps: int, eps: float
                 ) -> jax.Array:
        team = self.team
        mine = team.work[member]
        matrices, start = [], 0
        for i, _ in mine:
            layout, size = self.layouts[i], self.block_size[i]
            whole = jnp.zeros([layout.shape[d] for d in muon_owners.fan_dims(layout)],
                              self.dtype)
            for split in range(team.splits):
                block = received[split, start:start + size].reshape(self.blocks[i].shape[1:])
                whole = whole.at[_block_slices(layout, team, split)].set(block)
            matrices.append(_as_matrix(whole, layout))
            start += size
        by_shape: Dict[Tuple[int, ...], List[int]] = {}
        for k, matrix in enumerate(matrices):
            by_shape.setdefault(matrix.shape, []).append(k)
        done: Dict[int, jax.Array] = {}
        for members in by_shape.values():
            stack = newton_schulz(jnp.stack([matrices[k] for k in members]), steps=steps,
                                  eps=eps)
            done.update(zip(members, stack))
        wholes = [_from_matrix(done[k], self.layouts[i]) for k, (i, _) in enumerate(mine)]
        return jnp.stack([
            self._row([whole[_block_slices(self.layouts[i], team, split)].reshape(-1)
                       for whole, (i, _) in zip(wholes, mine)])
            for split in range(team.splits)])


def width_scale(layout: ParamLayout, consistent_rms: Optional[float]) -> float:
    """The update's scale from the whole matrix's shape: ``sqrt(max(1, fan_out / fan_in))``, or
    with ``consistent_rms`` ``sqrt(max(fan_in, fan_out)) * consistent_rms`` (an update of that
    RMS, AdamW's typical one: Moonshot's rule, to share AdamW's learning rate)."""
    fan_in, fan_out = muon_owners.fans(layout)
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
    matrices, the mesh axes that split its fan dimensions into blocks, its team (the devices
    that hold its matrices' blocks) and which member iterates each, and the Newton-Schulz FLOPs
    a device runs per step against its 1/``device_count`` share of all of them. ``labels``:
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
        count = math.prod(layout.shape[d] for d in muon_owners.batch_dims(layout))
        total += count * muon_owners.newton_schulz_flops(fan_in, fan_out, steps=ns_steps)
        blocks = ", ".join(f"dim {d} over {'x'.join(layout.split[d])}"
                            for d in layout.fan_in + layout.fan_out if layout.split[d]) or "-"
        mine = [owner_of[(i, j)] for j in range(muon_owners.local_matrices(layout))]
        team = mine[0][0]
        rows.append(f"  {layout.path:44s} {count:>4d} x {fan_in:>5d} x {fan_out:<6d} "
                    f"{blocks:18s} {'x'.join(team.replica_axes + team.split_axes) or '-':12s} "
                    f"{' '.join(str(member) for _, member in mine)}")
    # (A device is a member of every team; at most the most loaded member's FLOPs of each.)
    own = sum(max(team.load(d, steps=ns_steps) for d in range(team.count)) for team in teams)
    share = total / max(device_count, 1)
    return "\n".join([
        f"optimizer: Muon on {len(rows)} params ({ns_steps} Newton-Schulz steps), AdamW on "
        f"{sum(label == 'adam' for _, label in pairs)}",
        f"  {'param':44s} matrices (batch x fan-in x fan-out), blocks split, team "
        "(devices along), each matrix's owner (position along the team's axes)",
        *rows,
        f"  Newton-Schulz per device and step: {own / 1e9:.3g} GFLOP, {own / share:.2f}x its "
        f"1/{device_count} share of {total / 1e9:.3g} GFLOP (each matrix iterated by one "
        "owner, the owners' loads balanced: blocks to the owners and back by all-to-alls over "
        "the splitting axes, the replicas' results by an all-gather)"])
