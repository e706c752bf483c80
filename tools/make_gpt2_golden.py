"""Writes the GPT-2 parity golden: a tiny random Hugging Face GPT-2, inputs and its logits.

Needs torch and transformers (not Titanax dependencies); the test that reads the golden needs
neither. Regenerate with:

    pip install torch transformers numpy
    python tools/make_gpt2_golden.py tests/modules/models/data/gpt2_tiny_hf.npz
"""

import argparse

import numpy as np
import torch
import transformers

# Kept small so the committed file stays tiny; the architecture is GPT-2's in every other way.
CONFIG = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.GPT2Config(**CONFIG, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     layer_norm_epsilon=1e-5, activation_function="gelu_new",
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        # Random init is near-uniform; scale the weights up so logits are far from trivial.
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.ndim == 2:
                param.mul_(5.0)
    generator = np.random.default_rng(0)
    input_ids = generator.integers(0, CONFIG["vocab_size"], size=(2, CONFIG["n_positions"]))
    with torch.no_grad():
        logits = model(torch.tensor(input_ids)).logits.numpy()
    arrays = {f"state/{k}": v.detach().numpy() for k, v in model.state_dict().items()
              if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
    arrays.update({f"config/{k}": np.array(v) for k, v in CONFIG.items()})
    np.savez_compressed(args.output, input_ids=input_ids, logits=logits, **arrays)
    print(f"wrote {args.output}: logits {logits.shape}, std {logits.std():.3f}, "
          f"transformers {transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
