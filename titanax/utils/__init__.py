"""Small helpers shared across Titanax that belong to no single layer."""
