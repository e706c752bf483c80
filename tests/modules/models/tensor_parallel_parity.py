"""A language model's loss and every gradient, on one device and in local view under TP.

The reference is ``jax.value_and_grad`` of ``forward`` on one device. The tensor-parallel run
casts the params to varying (as the engine's step does), differentiates in local view inside
``shard_map`` on a ``data x model`` mesh, averages over ``data`` and sums the gradients of
params replicated over ``model`` (each rank holds a part of their gradient).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tests.numerics import parity_floats
from titanax.modules import functional
from titanax.parallel import axis_binding
from titanax.parallel import collectives, rules
from titanax.parallel.plan import TP, Plan
from titanax.runtime.mesh import MeshSpec


def tp_binding(*, sequence_parallel: bool = False,
               rules=None) -> axis_binding.AxisBinding:
    """The axis binding of a plan with TP over ``model`` (what the engine's layers ask), with
    ``rules`` as its logical axis rules."""
    return Plan(tensor_parallel=TP(axis="model", sequence_parallel=sequence_parallel),
                logical_axis_rules=dict(rules or {})).axis_binding()


def _loss(model, params, batch):
    return functional(model, None, params, (batch,), is_training=False)[0][0]


def one_device(model, *, vocab_size: int, perturb: bool = False):
    """``(params, batch, loss, grads)`` of ``model`` on one device; ``perturb`` moves every
    param off its initial value (biases off 0, norm scales off 1) so their uses are tested."""
    params = parity_floats(jax.jit(model.initialize_parameters_recursively)(
        jax.random.PRNGKey(0)))
    if perturb:
        params = jax.tree_util.tree_map(
            lambda p: p + 0.1 * jax.random.normal(jax.random.PRNGKey(p.size), p.shape), params)
    ids = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, vocab_size)
    batch = {"input_ids": ids, "target_ids": jnp.roll(ids, -1, axis=1)}
    value, grads = jax.jit(jax.value_and_grad(lambda p, b: _loss(model, p, b)))(params, batch)
    return params, batch, value, grads


def tensor_parallel(model, params, batch, *, tp_size: int, sequence_parallel: bool = False,
                    logical_axis_rules=None):
    """``((loss, grads), specs)`` of ``model`` under a plan's TP over ``model`` (with
    ``sequence_parallel``) on a ``data x model`` mesh, in the layout the plan's pipeline
    resolves (layer layouts; ``logical_axis_rules``: the plan's)."""
    mesh = MeshSpec(axes=("data", "model"), shape=(None, tp_size)).build()
    binding = tp_binding(sequence_parallel=sequence_parallel, rules=logical_axis_rules)
    with axis_binding.bound(binding):
        specs = rules.LayerLayouts().specs(model.create_parameter_specs_recursively(),
                                           dict(mesh.shape))
        model.check_partition_specs(specs)

    def local(p, b):
        p = collectives.cast_varying(p, ("data", "model"))
        loss, grads = jax.value_and_grad(lambda q: _loss(model, q, b))(p)

        def reduce(grad, spec):
            grad = collectives.pmean(grad, "data")
            # Params replicated over the model axis collect their gradient from every rank.
            return grad if "model" in rules.spec_axes(spec) else collectives.psum(grad, "model")

        return collectives.pmean(loss, "data"), jax.tree_util.tree_map(reduce, grads, specs)

    def bound_local(p, b):
        with axis_binding.bound(binding):
            return local(p, b)

    step = jax.jit(jax.shard_map(bound_local, mesh=mesh, in_specs=(specs, P("data")),
                                 out_specs=(P(), specs)))
    return step(params, batch), specs
