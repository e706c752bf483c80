"""A model's input limits, checked on host batches (the launcher cases: tests/test_launch_errors)."""

import numpy as np
import pytest

from titanax import errors
from titanax.modules.input_limits import InputLimit, check_batch

LIMITS = {"input_ids": InputLimit(num_ids=10, num_ids_field="vocab_size", max_length=4,
                                  max_length_field="max_seq_len")}


def test_a_batch_inside_the_limits_passes_and_other_entries_are_not_read():
    check_batch({"input_ids": np.array([[0, 9, 3, 1]]), "weights": np.array([-5.0])}, LIMITS,
                model_path="model")


@pytest.mark.parametrize("ids,field,text", [
    ([[0, 10, 1, 1]], "model.vocab_size", "the id 10"),
    ([[0, -1, 1, 1]], "model.vocab_size", "the id -1"),
    ([[0, 1, 1, 1, 1]], "model.max_seq_len", "5 positions"),
])
def test_an_id_or_a_length_past_the_limit_is_refused_naming_the_field(ids, field, text):
    with pytest.raises(errors.DataError) as info:
        check_batch({"input_ids": np.array(ids)}, LIMITS, model_path="model")
    assert info.value.path == field and text in info.value.message
