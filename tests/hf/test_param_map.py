"""The HF name map itself, where the reference-model tests do not reach: shapes of models no
transformers family builds yet."""
from titanax.hf import param_map
from titanax.modules.layers.moe import MoE
from titanax.modules.models.decoder import Decoder


def test_dense_first_layers_map_to_a_dense_mlp_whatever_the_attention():
    """``first_dense_layers`` under softmax attention (GLM-4.5's shape, not only DeepSeek-V3's
    latent one): the first layers' MLP names are the dense gate/up/down, the stack's experts."""
    cfg = Decoder.default_config().set(
        name="d", vocab_size=64, max_seq_len=16, num_layers=3, model_dim=16, num_heads=2,
        hidden_dim=32, first_dense_layers=1,
        moe=MoE.default_config().set(hidden_dim=8, num_experts=4, top_k=2))
    cfg.validate()
    paths = {m.path for m in param_map.tensor_maps(cfg)}
    head = {p for p in paths if p.startswith("decoder_head/0/mlp/")}
    assert head == {"decoder_head/0/mlp/gate_up_weight", "decoder_head/0/mlp/down/weight"}
    assert any(p.startswith("decoder/layer/mlp/router") for p in paths), sorted(paths)
