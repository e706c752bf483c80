"""Decoding at serving speed on the training mesh: a paged key/value cache and its book."""
