"""Parallel plans, sharding rules, sharding helpers and the typed collectives."""
