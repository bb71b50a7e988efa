"""Recipes built on pulsar-state's public API only (as kazoo's recipes are on kazoo's)."""

__all__: list[str] = []
