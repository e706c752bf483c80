"""Observability: loggers, throughput and MFU, and reports on the compiled step."""
