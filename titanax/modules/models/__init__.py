"""Models built from Titanax layers: GPT-2 and small MNIST classifiers."""
