"""Compression methods (registered by name)."""
