"""Settings written as text: booleans in environment variables and YAML files holding a mapping.

One reading for both places that take settings from text, ``flextensor.configuration.config_loading`` (``FT_*`` variables
and config files of ``OffloadConfig``) and ``flextensor.daemon.config`` (``FT_DAEMON_*`` and ``ftd.yaml``), so
that ``FT_X=on`` means the same to the library and to the daemon, and a YAML file is refused for the same
reasons with the same words.
"""

from __future__ import annotations

from typing import Any

__all__ = ["parse_bool", "yaml_mapping"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case, surrounding blanks ignored); ``ValueError`` otherwise."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("not a boolean (use 1/true/yes/on or 0/false/no/off)")


def yaml_mapping(text: str, source: str) -> dict[str, Any]:
    """The mapping a YAML document holds (an empty document is an empty mapping); ``ValueError`` naming
    ``source`` when the text is not YAML or its top level is not a mapping."""
    import yaml  # only YAML users pay for the import

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the top level must be a mapping of names to values, got {type(data).__name__}")
    return data
