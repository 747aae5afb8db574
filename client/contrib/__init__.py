"""Integrations with serving frameworks; each subpackage imports its framework, so none is imported here."""
