"""Files: Orbax checkpoints, and the JSON files and output directories commands use."""
