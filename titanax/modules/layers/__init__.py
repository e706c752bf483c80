"""Layers: each runs on one device and, unchanged, in local view inside shard_map."""
