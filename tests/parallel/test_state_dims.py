"""Which dimension of each param carries the ZeRO / FSDP split, and over which mesh axes."""
from jax.sharding import PartitionSpec as P

from titanax.modules.base_layer import ParameterSpec
from titanax.parallel import state_dims


def test_also_over_splits_what_the_layout_leaves_free_and_falls_back_to_the_zero_axis():
    """With ``also_over=(expert,)`` on data 2 x expert 4: a dense param goes over data x expert
    on a dimension 8 divides; an expert param (split over expert already) adds data alone; a
    param no dimension of which 8 divides is still split over data, as without also_over."""
    specs = {"dense": ParameterSpec(shape=(64, 6)), "experts": ParameterSpec(shape=(4, 6, 10)),
             "narrow": ParameterSpec(shape=(6, 10)), "tiny": ParameterSpec(shape=(3,))}
    partitions = {"dense": P(), "experts": P("expert"), "narrow": P(), "tiny": P()}
    dims, axes = state_dims.choose_dims_and_axes(
        specs, partitions, axis="data", axis_size=2, min_shard_size=0,
        also_over=(("expert", 4),))
    assert dims == {"dense": 0, "experts": 2, "narrow": 1, "tiny": None}
    assert axes == {"dense": ("data", "expert"), "experts": ("data",), "narrow": ("data",),
                    "tiny": None}
    placed = state_dims.add_axis(partitions, dims, "data", axes)
    assert placed == {"dense": P(("data", "expert")), "experts": P("expert", None, "data"),
                      "narrow": P(None, "data"), "tiny": P()}
