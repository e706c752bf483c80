"""LayerGroup: several different layers applied in order -- one repetition of a stack's pattern.

Today's models do not repeat one layer: Gemma 3 runs five sliding-window layers then a global
one, gpt-oss alternates sliding and full attention, Qwen 3.5 three linear-attention layers then a
full one. Such a stack is a ``Repeat`` of a group: the group's ``K`` layers are traced once, their
params stacked over the ``num_layers / K`` repetitions, so compile time stays flat in depth and a
pipeline cuts the stack at group boundaries. Layer ``g * K + i`` of the model is member ``i`` of
repetition ``g`` (param path ``.../layer/{i}/...``, slice ``g`` of the stacked axis).
"""

from __future__ import annotations

from typing import Sequence, Tuple

from titanax.config import REQUIRED, Required
from titanax.modules.base_layer import BaseLayer


class LayerGroup(BaseLayer):
    """``x = layer_{K-1}(... layer_0(x))``, children named ``"0" .. "K-1"``."""

    class Config(BaseLayer.Config):
        # The group's layers, in the order they run (each may differ in kind and size).
        layers: Required[Sequence[BaseLayer.Config]] = REQUIRED

        def _validate_values(self):
            if isinstance(self.layers, (list, tuple)) and not self.layers:
                yield "layers", "needs at least one layer"

    def __init__(self, cfg=None, *, parent=None, **fields):
        super().__init__(cfg, parent=parent, **fields)
        for index, layer in enumerate(self.config.layers):
            self._add_child(str(index), layer)

    @property
    def members(self) -> Tuple[BaseLayer, ...]:
        """The group's layers in order."""
        return tuple(self._children[str(i)] for i in range(len(self.config.layers)))

    def forward(self, x, **layer_inputs):
        """Every member in turn, each given ``layer_inputs`` (packed rows' ``segment_ids`` /
        ``positions``)."""
        for member in self.members:
            x = member(x, **layer_inputs)
        return x

    def decode(self, x, cache, *, start, offsets=None):
        """Every member's ``decode`` in turn; ``cache`` holds one cache per member, in order."""
        caches = []
        for member, member_cache in zip(self.members, cache):
            x, member_cache = member.decode(x, member_cache, start=start, offsets=offsets)
            caches.append(member_cache)
        return x, tuple(caches)


def pattern_members(group: BaseLayer) -> Sequence[BaseLayer]:
    """The layers one repetition of a stack runs: a group's members, or the one repeated
    layer."""
    return group.members if isinstance(group, LayerGroup) else (group,)
