"""What a model's inputs may hold, checked on the host before a batch reaches the device.

An id past the vocabulary or a position past the position table does not fail inside a jitted
step: ``jnp.take`` clamps or the vocab-parallel embedding masks it, and the run trains into NaN
(or, worse, into nothing) and blames the learning rate. A model that has such limits declares them
(``input_limits()``) and the engine checks every host batch against them -- a max and a min over
the batch's ids, microseconds next to a step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import numpy as np

from titanax import errors


@dataclasses.dataclass(frozen=True)
class InputLimit:
    """The limits of one batch entry (e.g. ``input_ids``)."""

    # Ids must lie in [0, num_ids) (None: no limit) ...
    num_ids: Optional[int] = None
    # ... as the model's config field of this name says (named in the error).
    num_ids_field: str = ""
    # Dimension 1 (the sequence) holds at most this many positions (None: no limit) ...
    max_length: Optional[int] = None
    # ... as the model's config field of this name says.
    max_length_field: str = ""


def check_batch(batch: Any, limits: Mapping[str, InputLimit], *, model_path: str) -> None:
    """Raises DataError naming ``<model_path>.<field>`` when a host batch breaks a limit."""
    if not limits or not isinstance(batch, Mapping):
        return
    for key, limit in limits.items():
        if key not in batch:
            continue
        values = np.asarray(batch[key])
        if limit.max_length is not None and values.ndim > 1 and \
                values.shape[1] > limit.max_length:
            raise errors.DataError(
                f"batch[{key!r}] holds {values.shape[1]} positions per example, the model at "
                f"most {limit.max_length}", path=f"{model_path}.{limit.max_length_field}",
                suggestion=f"raise {model_path}.{limit.max_length_field} to "
                           f"{values.shape[1]}, or feed shorter sequences (the input's seq_len)")
        if limit.num_ids is not None and values.size:
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= limit.num_ids:
                bad = high if high >= limit.num_ids else low
                raise errors.DataError(
                    f"batch[{key!r}] holds the id {bad}, outside the model's "
                    f"{limit.num_ids} ids [0, {limit.num_ids})",
                    path=f"{model_path}.{limit.num_ids_field}",
                    suggestion=f"set {model_path}.{limit.num_ids_field} to the number of ids "
                               "the data can hold (a tokenizer's vocabulary size, the classes; "
                               f"here at least {max(high + 1, limit.num_ids)}), or fix the "
                               "data's ids")
