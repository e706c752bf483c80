"""Import -> export gives the same Hugging Face directory back, and bad directories are named."""

import json
import os
import shutil

import numpy as np
import pytest

from tests.hf import reference_models as ref
from tests.numerics import CROSS_FRAMEWORK, FLOAT32, assert_close
from titanax import errors
from titanax.hf import exporter, importer
from titanax.hf.safetensors_io import SafetensorsFile

KINDS = ("llama", "qwen3", "qwen2", "mistral", "gpt2", "qwen3_moe", "mixtral", "qwen3_sliding",
         "qwen3_5", "gemma3", "gpt_oss", "deepseek_v3", "deepseek_v3_q_proj", "qwen3_5_moe")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_models")


def _tensors(directory):
    """name -> array of every safetensors file of an HF directory (via the reference reader)."""
    from safetensors.numpy import load_file
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_identical_and_loads_in_transformers(kind, root, tmp_path):
    source = ref.saved_model(kind, root)
    cfg = importer.model_config(source)
    out = exporter.export_params(importer.params_as_numpy(source, cfg), model_cfg=cfg,
                                 directory=str(tmp_path / "out"), source_dir=source)
    before, after = _tensors(source), _tensors(out)
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and np.array_equal(after[name], value), name
    ids = ref.token_ids()
    assert_close(ref.hf_logits(out, ids), ref.hf_logits(source, ids), bound=FLOAT32,
                 what=f"{kind} logits after the round trip")
    assert importer.model_config(out).debug_string() == cfg.debug_string()


def test_sharded_export_loads_through_its_index(root, tmp_path):
    source = ref.saved_model("llama", root)
    cfg = importer.model_config(source)
    out = exporter.export_params(importer.params_as_numpy(source, cfg), model_cfg=cfg,
                                 directory=str(tmp_path / "out"), max_shard_bytes=64 * 1024)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    ids = ref.token_ids()
    assert_close(ref.hf_logits(out, ids), ref.hf_logits(source, ids), bound=FLOAT32,
                 what="logits of the sharded export")
    # And Titanax reads the sharded form back.
    assert_close(importer.params_as_numpy(out, cfg), importer.params_as_numpy(source, cfg),
                 bound=0.0, what="params read back from the shards")


def _copy(source, tmp_path, name="bad"):
    target = tmp_path / name
    shutil.copytree(source, target)
    return str(target)


def test_a_directory_without_config_json_is_named(root, tmp_path):
    bad = _copy(ref.saved_model("llama", root), tmp_path)
    os.remove(os.path.join(bad, "config.json"))
    with pytest.raises(errors.HFError, match="no config.json") as e:
        importer.model_config(bad)
    assert e.value.path.endswith("config.json")


def test_an_unknown_model_type_is_named(root, tmp_path):
    bad = _copy(ref.saved_model("llama", root), tmp_path)
    config = json.load(open(os.path.join(bad, "config.json")))
    config["model_type"] = "falcon"
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(errors.HFError, match="model_type 'falcon' is not supported") as e:
        importer.model_config(bad)
    assert e.value.path.endswith("config.json: model_type")


GEMMA_ROPE = {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
              "full_attention": {"rope_type": "default", "rope_theta": 1e6}}


@pytest.mark.parametrize("kind,key,value,message", [
    ("llama", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0},
     "rope_type='longrope'"),
    ("llama", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
     "yarn scaling needs original_max_position_embeddings"),
    ("llama", "hidden_act", "gelu", "hidden_act='gelu'"),
    ("llama", "some_new_switch", True, "does not know: some_new_switch"),
    ("gemma3", "final_logit_softcapping", 30.0, "soft-capping is Gemma 2's"),
    ("gemma3", "attn_logit_softcapping", 50.0, "soft-capping is Gemma 2's"),
    ("gemma3", "use_bidirectional_attention", True, "is causal"),
    ("gemma3", "rope_parameters", GEMMA_ROPE, "sliding layers by plain RoPE"),
    ("gemma3", "hidden_activation", "gelu", "GELU \\(tanh\\) gated"),
    ("gpt_oss", "quantization_config", {"quant_method": "mxfp4"}, "reads unquantised weights"),
    ("gpt_oss", "experts_per_token", 3, "another top-k"),
    ("deepseek_v3", "rope_interleave", False, "interleaved pairs"),
    ("deepseek_v3", "rope_interleave", None, "interleaved pairs"),
    ("deepseek_v3", "norm_topk_prob", None, "renormalises the chosen gates"),
    ("deepseek_v3", "rms_norm_eps", 1e-5, "latent norms use 1e-6"),
    ("deepseek_v3", "norm_topk_prob", False, "renormalises the chosen gates"),
    ("deepseek_v3", "num_key_value_heads", 2, "as many key/value heads"),
    ("deepseek_v3", "qk_head_dim", 7, "qk_nope_head_dim \\+ qk_rope_head_dim"),
])
def test_a_config_field_titanax_cannot_reproduce_is_named(root, tmp_path, kind, key, value,
                                                          message):
    bad = _copy(ref.saved_model(kind, root), tmp_path)
    config = json.load(open(os.path.join(bad, "config.json")))
    config[key] = value
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(errors.HFError, match=message):
        importer.model_config(bad)


def _rewrite_without(directory, drop=None, reshape=None):
    """The directory's weights rewritten without tensor ``drop`` / with ``reshape`` truncated."""
    from safetensors.numpy import load_file, save_file
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, path)


def test_a_missing_tensor_is_named_with_the_param_it_feeds(root, tmp_path):
    bad = _copy(ref.saved_model("llama", root), tmp_path)
    _rewrite_without(bad, drop="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(errors.HFError, match=r"'model.layers.1.self_attn.k_proj.weight' is "
                                             r"missing \(Titanax param decoder/layer/attn/k_w"):
        importer.params_as_numpy(bad)


def test_a_shape_mismatch_is_named(root, tmp_path):
    bad = _copy(ref.saved_model("qwen3", root), tmp_path)
    _rewrite_without(bad, reshape="model.layers.0.mlp.down_proj.weight")
    with pytest.raises(errors.HFError, match=r"model.layers.0.mlp.down_proj.weight \(63, 96\) "
                                             r"cannot make Titanax param decoder/layer/mlp/down"):
        importer.params_as_numpy(bad)


def test_a_leftover_tensor_is_named(root, tmp_path):
    bad = _copy(ref.saved_model("qwen2", root), tmp_path)
    config = json.load(open(os.path.join(bad, "config.json")))
    config["num_hidden_layers"] = 1
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(errors.HFError, match="have no place in the model config.json describes: "
                                             "model.layers.1"):
        importer.params_as_numpy(bad)


def _with_prediction_layer(source, tmp_path):
    """The reference DeepSeek-V3 directory with a multi-token-prediction layer after its three
    layers, as published checkpoints hold one (``num_nextn_predict_layers``: 1): an MoE
    layer's tensors (layer 2's, renamed), its own norms and projection, the embedding's and
    head's copies."""
    from safetensors.numpy import load_file, save_file
    target = _copy(source, tmp_path, "with_mtp")
    path = os.path.join(target, "model.safetensors")
    tensors = load_file(path)
    rng = np.random.default_rng(0)
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:
        tensors[name.replace("layers.2.", "layers.3.")] = \
            tensors[name] + rng.normal(size=tensors[name].shape).astype(np.float32)
    for name, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                        ("shared_head.norm.weight", (64,)), ("eh_proj.weight", (64, 128))):
        tensors[f"model.layers.3.{name}"] = rng.normal(size=shape).astype(np.float32)
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file(tensors, path)
    config_path = os.path.join(target, "config.json")
    config = json.load(open(config_path))
    json.dump({**config, "num_nextn_predict_layers": 1}, open(config_path, "w"))
    return target, tensors


def test_deepseek_v3s_prediction_layer_is_read_only_for_a_depth_the_model_holds(root, tmp_path):
    """A published DeepSeek-V3's multi-token-prediction layer is left unread without depths (as
    transformers leaves it: the main model's params are the same), read into the depth with
    ``mtp_depths=1``, and exported back bit for bit -- copies of the shared embedding and head
    included -- into a directory transformers still loads with the same logits; the same
    tensor in a checkpoint that declares no such layer is refused, as is a depth it lacks."""
    source = ref.saved_model("deepseek_v3", root)
    with_mtp, tensors = _with_prediction_layer(source, tmp_path)
    want = importer.params_as_numpy(source)
    got = importer.params_as_numpy(with_mtp)
    assert "prediction" not in got
    assert_close(got, want, bound=0.0, what="the main model's params")
    cfg = importer.model_config(with_mtp).set(mtp_depths=1)
    params = importer.params_as_numpy(with_mtp, cfg)
    depth = params["prediction"]["0"]
    np.testing.assert_array_equal(depth["project"]["weight"],
                                  tensors["model.layers.3.eh_proj.weight"].T)
    np.testing.assert_array_equal(depth["block"]["mlp"]["router"]["expert_bias"],
                                  tensors["model.layers.3.mlp.gate.e_score_correction_bias"])
    out = exporter.export_params(params, model_cfg=cfg, directory=str(tmp_path / "out"),
                                 source_dir=with_mtp)
    after = _tensors(out)
    assert sorted(after) == sorted(tensors)
    for name, value in tensors.items():
        assert np.array_equal(after[name], value), name
    assert json.load(open(os.path.join(out, "config.json")))["num_nextn_predict_layers"] == 1
    ids = ref.token_ids()
    assert_close(ref.hf_logits(out, ids), ref.hf_logits(source, ids), bound=FLOAT32,
                 what="transformers' logits of the export with its prediction layer")
    with pytest.raises(errors.HFError, match="model.layers.4"):
        importer.params_as_numpy(with_mtp, cfg.clone(mtp_depths=2))
    undeclared = _copy(with_mtp, tmp_path, "undeclared")
    config_path = os.path.join(undeclared, "config.json")
    config = json.load(open(config_path))
    json.dump({**config, "num_nextn_predict_layers": 0}, open(config_path, "w"))
    with pytest.raises(errors.HFError, match="have no place .*model.layers.3"):
        importer.params_as_numpy(undeclared)


def test_deepseek_v3s_and_kimi_k2s_own_config_json_read_as_transformers_reads_them(root,
                                                                                   tmp_path):
    """DeepSeek's published config.json (its code's keys beside transformers': auto_map,
    scoring_func, topk_method, moe_layer_freq, ep_size, the balancing loss's; the older RoPE
    spelling) and Kimi K2's (model_type kimi_k2: the same architecture) read as the model
    transformers builds; FP8 weights and another scoring are refused by name."""
    source = ref.saved_model("deepseek_v3", root)
    want = importer.model_config(source).debug_string()
    config = json.load(open(os.path.join(source, "config.json")))
    rope = config.pop("rope_parameters")
    published = {**config, "rope_theta": rope.pop("rope_theta"),
                 "rope_scaling": {"type": rope.pop("rope_type"), **rope},
                 "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
                 "aux_loss_alpha": 0.001, "ep_size": 1, "moe_layer_freq": 1,
                 "scoring_func": "sigmoid", "seq_aux": True, "topk_method": "noaux_tc",
                 "num_nextn_predict_layers": 0}
    for name, changes in (("published", {}), ("kimi", {"model_type": "kimi_k2"})):
        directory = _copy(source, tmp_path, name)
        json.dump({**published, **changes}, open(os.path.join(directory, "config.json"), "w"))
        assert importer.model_config(directory).debug_string() == want, name
    for key, value, message in (
            ("quantization_config", {"quant_method": "fp8", "fmt": "e5m2",
                                     "weight_block_size": [128, 128]},
             "FP8 blocks as DeepSeek publishes them"),
            ("scoring_func", "softmax", "scoring_func='softmax'")):
        directory = _copy(source, tmp_path, key)
        json.dump({**published, key: value}, open(os.path.join(directory, "config.json"), "w"))
        with pytest.raises(errors.HFError, match=message):
            importer.model_config(directory)


def test_a_deepseek_v3_router_without_its_choosing_bias_is_not_exported_as_deepseek_v3(root):
    """transformers would choose with a zero bias: another model."""
    from titanax.hf.model_configs import hf_config_from_model  # pylint: disable=import-outside-toplevel
    cfg = importer.model_config(ref.saved_model("deepseek_v3", root))
    cfg.moe.router.choosing_bias = False
    with pytest.raises(errors.HFError, match="chooses with a bias"):
        hf_config_from_model(cfg)


def test_export_refuses_a_directory_that_holds_anything(root, tmp_path):
    source = ref.saved_model("gpt2", root)
    cfg = importer.model_config(source)
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(errors.HFError, match="not an empty directory"):
        exporter.export_params(importer.params_as_numpy(source, cfg), model_cfg=cfg,
                               directory=str(target))
    assert os.listdir(target) == ["notes.txt"]


def test_safetensors_views_read_what_the_reference_wrote(root):
    from safetensors.numpy import load_file
    path = os.path.join(ref.saved_model("mistral", root), "model.safetensors")
    ours = SafetensorsFile(path)
    for name, value in load_file(path).items():
        assert np.array_equal(ours.view(name), value), name


def test_export_refuses_a_family_that_would_drop_a_part(root):
    from titanax.hf.model_configs import hf_config_from_model
    llama = importer.model_config(ref.saved_model("llama", root))  # llama3 scaling, no QK-norm
    with pytest.raises(errors.HFError, match="qwen3_5 and gemma3_text have QK-norm and no other"):
        hf_config_from_model(llama, model_type="qwen3")
    windowed = importer.model_config(ref.saved_model("mistral", root))
    with pytest.raises(errors.HFError, match="only mistral, mixtral and gemma3_text have one"):
        hf_config_from_model(windowed, model_type="llama")
    with pytest.raises(errors.HFError, match="mixtral is a mixture of experts and the model"):
        hf_config_from_model(windowed, model_type="mixtral")
    # What the softmax families' routers do not compute: a sigmoid router, a choosing bias.
    moe = importer.model_config(ref.saved_model("qwen3_moe", root))
    moe.moe.router.scoring = "sigmoid"
    with pytest.raises(errors.HFError, match="softmax top-k with unscaled gates"):
        hf_config_from_model(moe)
    moe = importer.model_config(ref.saved_model("mixtral", root))
    moe.moe.router.balance_rate = 0.01
    with pytest.raises(errors.HFError, match="the expert bias that chooses"):
        hf_config_from_model(moe)
    # A shared expert with its own gate: Qwen 3.5 MoE's; DeepSeek-V3's shared experts have none.
    qwen3_5_moe = importer.model_config(ref.saved_model("qwen3_5_moe", root))
    with pytest.raises(errors.HFError, match="qwen3_5_moe_text has a shared expert with its own"):
        hf_config_from_model(qwen3_5_moe.clone(moe=qwen3_5_moe.moe.clone(shared_gate=False)))
    deepseek = importer.model_config(ref.saved_model("deepseek_v3", root))
    with pytest.raises(errors.HFError, match="shared experts have no gate of their own"):
        hf_config_from_model(deepseek.clone(moe=deepseek.moe.clone(shared_gate=True)))
    # Latent attention and dense first layers: DeepSeek-V3's only.
    deepseek = importer.model_config(ref.saved_model("deepseek_v3", root))
    with pytest.raises(errors.HFError, match="deepseek_v3 -- and only it -- has latent"):
        hf_config_from_model(deepseek, model_type="qwen3_moe")
    with pytest.raises(errors.HFError, match="latent norms use epsilon 1e-6"):
        hf_config_from_model(deepseek.clone(norm_eps=1e-5))
    # A layer pattern: only Qwen's layer_types name each layer's kind; no family has Gated
    # DeltaNet layers yet, nor another RoPE base for the sliding layers.
    alternating = importer.model_config(ref.saved_model("qwen3_sliding", root))
    with pytest.raises(errors.HFError, match="only qwen2, qwen3, qwen3_moe, qwen3_5_text and "
                                             "gemma3_text name each"):
        hf_config_from_model(alternating, model_type="mistral")
    # Gemma 3's sandwich norms and scaled embeddings: in no other family, and needed by it.
    gemma = importer.model_config(ref.saved_model("gemma3", root))
    with pytest.raises(errors.HFError, match="qwen3 does not scale its embeddings"):
        hf_config_from_model(gemma, model_type="qwen3")
    with pytest.raises(errors.HFError, match="gemma3_text has branch_output_norms=True"):
        hf_config_from_model(alternating, model_type="gemma3_text")
    with pytest.raises(errors.HFError, match="sliding_rope_theta"):
        hf_config_from_model(alternating.clone(sliding_rope_theta=1e4))
    qwen3 = importer.model_config(ref.saved_model("qwen3", root)).set(attention_output_bias=True)
    with pytest.raises(errors.HFError, match="no Hugging Face family computes"):
        hf_config_from_model(qwen3)


def test_published_gpt2_names_without_the_transformer_prefix_import(root, tmp_path):
    """The hub's GPT-2 files store GPT2Model's names (h.0..., wte.weight) and legacy config
    keys (n_special, predict_special_tokens)."""
    from safetensors.numpy import load_file, save_file
    bare = _copy(ref.saved_model("gpt2", root), tmp_path, "bare")
    path = os.path.join(bare, "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in load_file(path).items()}, path)
    config = json.load(open(os.path.join(bare, "config.json")))
    json.dump({**config, "n_special": 0, "predict_special_tokens": True},
              open(os.path.join(bare, "config.json"), "w"))
    ids = ref.token_ids()
    cfg = importer.model_config(bare)
    from titanax.modules.module import functional
    logits, _ = functional(cfg.instantiate(), None, importer.params_as_numpy(bare, cfg), (ids,),
                           method="logits", is_training=False)
    assert_close(np.asarray(logits), ref.hf_logits(ref.saved_model("gpt2", root), ids),
                 bound=CROSS_FRAMEWORK, what="logits of the unprefixed GPT-2")


def test_broken_files_and_targets_are_named_not_tracebacks(root, tmp_path):
    source = ref.saved_model("llama", root)
    # An index that maps a tensor to a shard that does not hold it.
    sharded = str(tmp_path / "sharded")
    cfg = importer.model_config(source)
    exporter.export_params(importer.params_as_numpy(source, cfg), model_cfg=cfg,
                           directory=sharded, max_shard_bytes=64 * 1024)
    index_path = os.path.join(sharded, "model.safetensors.index.json")
    index = json.load(open(index_path))
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = next(
        f for f in files if f != index["weight_map"]["model.norm.weight"])
    json.dump(index, open(index_path, "w"))
    with pytest.raises(errors.HFError, match="'model.norm.weight' is not in this file"):
        importer.params_as_numpy(sharded, cfg)
    # An export under a file.
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(errors.HFError, match="is not a directory"):
        exporter.check_target(str(blocker / "sub"))
    # A llama3 scaling field left null, or missing.
    for scaling in ({"rope_type": "llama3", "factor": None, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                    {"rope_type": "llama3"}):
        bad = _copy(source, tmp_path, f"rope{len(scaling)}")
        config = json.load(open(os.path.join(bad, "config.json")))
        config["rope_parameters"] = {"rope_theta": 5e5, **scaling}
        json.dump(config, open(os.path.join(bad, "config.json"), "w"))
        with pytest.raises(errors.HFError, match="llama3 scaling needs"):
            importer.model_config(bad)


@pytest.mark.parametrize("changes,message", [
    (dict(norm="layer"), "norm='rms'"),
    (dict(mlp_activation="gelu_tanh"), "mlp_activation='silu'"),
    (dict(gated_mlp=False), "gated_mlp=True"),
    (dict(position_embedding="learned"), "learned positions are GPT-2's"),
])
def test_a_decoder_no_hugging_face_family_computes_is_refused(changes, message):
    """The family's GPT-2 switches on a RoPE model (or learned positions on a Llama): no HF
    family would compute it, so the export says so instead of writing a model that loads and
    is wrong."""
    from titanax.hf.model_configs import hf_config_from_model  # pylint: disable=import-outside-toplevel
    from titanax.modules.models.decoder import Decoder, gpt2_config  # pylint: disable=import-outside-toplevel
    cfg = Decoder.default_config().set(vocab_size=64, max_seq_len=16, num_layers=2,
                                       model_dim=32, num_heads=4, hidden_dim=64, **changes)
    with pytest.raises(errors.HFError) as raised:
        hf_config_from_model(cfg)
    assert message in str(raised.value)
    # GPT-2 written out with its heads' default values is still GPT-2.
    gpt2 = gpt2_config("small").set(num_kv_heads=12, head_dim=64)
    assert hf_config_from_model(gpt2)["model_type"] == "gpt2"


def test_a_chat_template_the_run_chose_is_the_exported_tokenizers(root, tmp_path):
    """A run that named its chat template (``tokenizer.chat_template``) exports it in
    tokenizer_config.json, replacing the one its tokenizer shipped: transformers renders chats as
    the model was trained."""
    from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
    from titanax.data import bundled, chat  # pylint: disable=import-outside-toplevel
    tokenizer_dir = tmp_path / "tokenizer"
    shutil.copytree(bundled.resolve("bundled:sums"), tokenizer_dir)
    (tokenizer_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    source = ref.saved_model("llama", root)
    cfg = importer.model_config(source)
    out = exporter.export_params(importer.params_as_numpy(source, cfg), model_cfg=cfg,
                                 directory=str(tmp_path / "out"), source_dir=source,
                                 tokenizer_dir=str(tokenizer_dir),
                                 chat_template=chat.named_template(chat.PLAIN))
    assert not os.path.exists(os.path.join(out, "chat_template.jinja"))
    with open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["chat_template"] == chat.DEFAULT_TEMPLATE
    rendered = AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("### user\n1+1=\n\n### assistant\n"), rendered


def test_a_gpt_oss_config_without_rope_reads_as_transformers_fills_it_in(root, tmp_path):
    """No rope_parameters and no rope_scaling: transformers' gpt-oss defaults -- YaRN, factor
    32 over 4,096 tokens, base 150,000 -- not plain RoPE."""
    from transformers import GptOssConfig
    bad = _copy(ref.saved_model("gpt_oss", root), tmp_path)
    config = json.load(open(os.path.join(bad, "config.json")))
    del config["rope_parameters"]
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    theirs = GptOssConfig.from_pretrained(bad).rope_parameters
    ours = importer.model_config(bad)
    assert ours.rope_theta == theirs["rope_theta"] == 150000.0
    for key in ("factor", "beta_fast", "beta_slow", "truncate",
                "original_max_position_embeddings"):
        assert getattr(ours.rope_scaling, key) == theirs[key], key
