"""Hugging Face model directories in and out: configs, safetensors weights, tokenizers.

``importer`` reads an HF directory into Titanax params (streamed into their shards),
``exporter`` writes one that ``transformers.AutoModelForCausalLM.from_pretrained`` loads,
``model_configs`` maps ``config.json`` both ways, ``param_map`` says which HF tensors make each
param. Nothing here imports torch or transformers.
"""
