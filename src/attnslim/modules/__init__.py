"""Replacement nn.Modules (registered by class name: the load allowlist)."""
