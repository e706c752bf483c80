"""Input pipelines (grain), data sources and the byte tokenizer."""
