"""Parsers for what an OCI runtime hands a hook: the state (stdin) and the bundle's config.json."""
