"""Expert parallelism: the experts of every mixture-of-experts layer split over a mesh axis.

``EP`` is the plan part (``Plan.expert_parallel``). The expert axis is a *batch* axis as well:
the batch's rows are split over data x expert, so outside the MoE layers every device works on its
own rows as under data parallelism (with the same rows as a data-only mesh of the same size: an
EP run and a DP run of one size see the same batch shards). Inside an MoE layer
(``modules/layers/moe.py``) each rank holds ``E / EP`` experts; tokens go to the rank of their
expert with one ``all_to_all`` over the axis and come back with another.

Gradients: the params outside the experts are replicated over the axis and reduced over it with
the data axis, in the step's one all-reduce over data x expert; the experts' own are split over it
and need no reduction there (the all-to-alls' transposes already brought every rank's tokens'
contributions home), so they cross the data axis only (``train/reducer.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Tuple


from titanax.config import Configurable


class EP(Configurable):
    """Expert parallelism over ``axis`` (see the module docstring)."""

    class Config(Configurable.Config):
        # Mesh axis the experts (and the batch's rows) are split over.
        axis: str = "expert"

    def describe(self, *, size: int, layers: List[Tuple[str, Any]]) -> str:
        """--explain's lines: experts per rank and what each MoE layer sends (``layers``: the
        model's MoE layers with their paths)."""
        lines = [f"expert parallelism over {self.config.axis!r} ({size} devices): rows split "
                 "over it like a data axis; per MoE layer 2 all-to-alls forward (dispatch, "
                 "combine) and 2 backward"]
        for path, layer in layers:
            cfg = layer.config
            if cfg.dispatch == "dropless":
                slots = ("dropless, emulated with a slot per token (C = T: ragged_all_to_all "
                         "runs only on accelerators, and Titanax does not use it yet)")
            else:
                slots = (f"capacity: C = ceil({cfg.capacity_factor:g} x T x {cfg.top_k} / "
                         f"{cfg.num_experts}) slots per expert for a device's T tokens, the "
                         "rest dropped")
            lines.append(f"  {path}: {cfg.num_experts} experts, {cfg.num_experts // size} per "
                         f"rank, top-{cfg.top_k}; {slots}; each all-to-all carries "
                         f"{cfg.num_experts} x C x {cfg.model_dim} values per device")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """EP's transform in the layout pipeline (parallel/layout.py): the rows split over the
    expert axis too; that axis crossed by the data all-reduce for the params replicated over
    it, while the experts' own gradients -- split over it, and already summed over it by the
    layers' all-to-alls -- skip it. (The experts' dimension carries the axis from the axis
    binding, as heads carry TP's.)"""

    axis: str
    name: str = "expert rows (EP)"

    def apply(self, layout):
        batch = layout.batch
        batch = dataclasses.replace(batch, row_axes=batch.row_axes + (self.axis,),
                                    fold_axes=batch.fold_axes + (self.axis,),
                                    layer_summed_axes=batch.layer_summed_axes + (self.axis,))
        return layout.evolve(self.name, batch=batch)
