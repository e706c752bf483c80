"""DeepSeek-V3 as published, in FP8 blocks (hf/fp8_blocks.py): a tiny random transformers model's
projections quantised to float8_e4m3fn with one scale per 16 x 16 block (edge blocks partial),
written as DeepSeek writes them (``W``, ``W_scale_inv``, ``quantization_config``). Its import
is the same params, bit for bit, as the directory of the weights dequantised here by hand, and
its logits are transformers' on that directory; what does not fit is refused by name."""

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from tests.hf import reference_models as ref
from tests.numerics import CROSS_FRAMEWORK, assert_close, assert_identical
from titanax import errors
from titanax.hf import importer

BLOCK = (16, 16)
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK)}


def _quantised(weight):
    """``(fp8 weight, scales)`` of a float32 ``[out, in]`` torch tensor, DeepSeek's way: each
    block scaled so its largest magnitude is e4m3's largest (448)."""
    import torch
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    scales = torch.ones(grid, dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scales[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
    expanded = scales.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
    return (weight / expanded[:rows, :cols]).to(torch.float8_e4m3fn), scales


def _rounded(tree, dtype):
    return jax.tree_util.tree_map(lambda x: np.asarray(x).astype(dtype), tree)


def _is_projection(name, tensor):
    return tensor.ndim == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight"))


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """``(fp8 directory, its weights dequantised by hand as float32)``."""
    import torch
    from safetensors.torch import load_file, save_file
    source = ref.saved_model("deepseek_v3", tmp_path_factory.getbasetemp())
    root = tmp_path_factory.mktemp("fp8")
    tensors = load_file(os.path.join(source, "model.safetensors"))
    quantised, dequantised = {}, {}
    for name, tensor in tensors.items():
        if not _is_projection(name, tensor):
            quantised[name] = dequantised[name] = tensor
            continue
        weight, scales = _quantised(tensor)
        quantised[name], quantised[name + "_scale_inv"] = weight, scales
        expanded = scales.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
        dequantised[name] = weight.to(torch.float32) * expanded[:tensor.shape[0],
                                                                 :tensor.shape[1]]
    config = json.load(open(os.path.join(source, "config.json"), encoding="utf-8"))
    made = {}
    for kind, weights, extra in (("fp8", quantised, {"quantization_config": QUANTIZATION}),
                                 ("dequantised", dequantised, {})):
        directory = str(root / kind)
        os.makedirs(directory)
        save_file(weights, os.path.join(directory, "model.safetensors"))
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump({**config, **extra}, f)
        made[kind] = directory
    return made["fp8"], made["dequantised"]


def test_an_fp8_import_is_the_hand_dequantised_model_bit_for_bit(directories):
    fp8, dequantised = directories
    assert importer.model_config(fp8).debug_string() == \
        importer.model_config(dequantised).debug_string()
    want = importer.params_as_numpy(dequantised)
    assert_identical(importer.params_as_numpy(fp8), want, what="params imported from FP8 blocks")
    # Into bfloat16 (each weight dequantised straight into it): the float32 import, rounded.
    assert_identical(importer.params_as_numpy(fp8, dtype=ml_dtypes.bfloat16),
                     _rounded(want, ml_dtypes.bfloat16),
                     what="params imported from FP8 blocks into bfloat16")
    # The launcher's shape check reads headers (and each weight's scales' shape), nothing more.
    importer.check_tensor_shapes(fp8, importer.model_config(fp8))


def test_an_fp8_directorys_logits_are_transformers_on_its_dequantised_weights(directories):
    fp8, dequantised = directories
    ids = ref.token_ids(rows=2, length=12)
    engine = ref.engine_for(fp8, data=1)
    ours = np.asarray(engine.steps.model_method("logits")(engine.state.params, ids))
    assert_close(ours, ref.hf_logits(dequantised, ids), bound=CROSS_FRAMEWORK,
                 what="logits of the FP8 directory")


def test_fp8_weights_without_their_scales_or_their_quantization_config_are_refused(
        directories, tmp_path):
    fp8, _ = directories
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    unscaled = str(tmp_path / "unscaled")
    shutil.copytree(fp8, unscaled)
    save_file({k: v for k, v in tensors.items() if k != name + "_scale_inv"},
              os.path.join(unscaled, "model.safetensors"))
    with pytest.raises(errors.HFError, match=f"tensor '{name}_scale_inv' is missing"):
        importer.params_as_numpy(unscaled)
    unnamed = str(tmp_path / "unnamed")
    shutil.copytree(fp8, unnamed)
    config = json.load(open(os.path.join(fp8, "config.json"), encoding="utf-8"))
    del config["quantization_config"]
    with open(os.path.join(unnamed, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(errors.HFError, match="stored in FP8 .* names no FP8 block"):
        importer.params_as_numpy(unnamed)
