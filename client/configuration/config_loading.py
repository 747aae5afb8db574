"""Build an `OffloadConfig` from keyword arguments, ``FT_*`` environment variables and a config file.

Precedence (highest first): explicit kwargs > environment > file > built-in defaults. Each source is read
into a plain ``{option: value}`` mapping together with where every value came from, so that any error can
name the option, the source (``environment variable FT_GPU_DEVICE`` or ``file /etc/ft.yaml``), the value and
what is allowed.

Parsing rules for values that arrive as text (environment variables, INI files, and strings in YAML/JSON for
options that are not strings):

- bool: ``1/0/true/false/yes/no/on/off`` (case-insensitive).
- int, float: Python literals (``int("4")``, ``float("0.8")``); ranges are checked by ``OffloadConfig``.
- list (pattern options): comma-separated, whitespace around items stripped, empty items dropped.
- optional float (``max_gpu_mem_fraction``): ``none``, ``null`` or empty mean ``None``.
- optional str (``shm_namespace``, ``shm_dir``, ``profile_storage_dir``): empty means ``None``. ``none``/``null`` are NOT
  special there: they are legal directory and namespace names.

Environment-only loading (``load_config_from_env``, or ``load_config`` with ``use_env=True`` and no file)
defaults ``enabled`` to ``False`` unless ``FT_ENABLED`` is set: a partially configured environment must not
switch offloading on by accident (environment-only loading).

Other parts of flextensor read their own ``FT_*`` variables (the daemon's ``FT_DAEMON_*``, the compile path's
``FT_EXTERNAL_COMPILE``); those are skipped here. Any other unknown ``FT_*`` variable is an error that
suggests the nearest option, because a misspelt variable silently doing nothing is worse than a loud failure.
A new part that adds its own ``FT_*`` variables must add them to ``FOREIGN_ENV_PREFIXES``/``FOREIGN_ENV_NAMES``.
"""

from __future__ import annotations

import configparser
import difflib
import json
import logging
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from flextensor.configuration.config import OffloadConfig, validate_option
from flextensor.shm.text_settings import parse_bool, yaml_mapping

__all__ = [
    "load_config",
    "load_config_from_env",
    "load_config_from_file",
    "ENV_PREFIX",
    "INI_SECTION",
    "FOREIGN_ENV_PREFIXES",
    "FOREIGN_ENV_NAMES",
]

logger = logging.getLogger(__name__)

ENV_PREFIX = "FT_"
INI_SECTION = "flextensor"
# Suffixes (after the prefix) of environment variables owned by other flextensor parts; never config options.
FOREIGN_ENV_PREFIXES: tuple[str, ...] = ("DAEMON_",)
FOREIGN_ENV_NAMES: tuple[str, ...] = ("EXTERNAL_COMPILE",)

_INI_SUFFIXES = (".ini", ".conf", ".cfg")
_YAML_SUFFIXES = (".yaml", ".yml")
_JSON_SUFFIXES = (".json",)
_NONE = frozenset({"", "none", "null"})

# Options that cannot be expressed as text: they must be passed in code.
_CODE_ONLY = frozenset({"load_strategy"})

Kind = Literal["bool", "int", "float", "optional_float", "str", "optional_str", "list"]


@dataclass(frozen=True)
class _Value:
    """One option value read from a source, with a human-readable description of that source."""

    value: Any
    source: str  # e.g. "environment variable FT_GPU_DEVICE", "file /path/ft.ini"


# --------------------------------------------------------------------------------------------------------------
# Option kinds, derived from OffloadConfig's annotations so that a new option needs no change here.
# --------------------------------------------------------------------------------------------------------------


def _kind_of(annotation: Any) -> Kind:
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"unsupported option annotation {annotation!r}")
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if origin is Literal:
        annotation = type(typing.get_args(annotation)[0])
    elif origin is list:
        return "list"
    if annotation is bool and not optional:
        return "bool"
    if annotation is int and not optional:
        return "int"
    if annotation is float:
        return "optional_float" if optional else "float"
    if annotation is str:
        return "optional_str" if optional else "str"
    raise TypeError(f"unsupported option annotation {annotation!r}")


def _option_kinds() -> dict[str, Kind]:
    hints = typing.get_type_hints(OffloadConfig)
    return {name: _kind_of(hints[name]) for name in OffloadConfig.field_names() if name not in _CODE_ONLY}


_KINDS: dict[str, Kind] = _option_kinds()

_ALLOWED_TEXT: dict[str, str] = {
    "bool": "a boolean: 1/0, true/false, yes/no, on/off (case-insensitive)",
    "int": "an integer",
    "float": "a number",
    "optional_float": "a number, or none/null/empty for None",
    "str": "a string",
    "optional_str": "a string, or empty for None",
    "list": "a comma-separated list of patterns",
}


# --------------------------------------------------------------------------------------------------------------
# Text parsing
# --------------------------------------------------------------------------------------------------------------


def _parse_text(kind: Kind, text: str) -> Any:
    """Parse one textual value; raises ValueError with a short reason (the caller adds option and source)."""
    stripped = text.strip()
    if kind == "bool":
        return parse_bool(stripped)
    if kind == "int":
        return int(stripped)
    if kind == "float":
        return float(stripped)
    if kind == "optional_float":
        return None if stripped.lower() in _NONE else float(stripped)
    if kind == "optional_str":
        return stripped or None
    if kind == "list":
        return [item.strip() for item in stripped.split(",") if item.strip()]
    return stripped


def _convert(name: str, raw: Any, source: str, *, from_text: bool) -> Any:
    """Turn a raw source value into the option's value and check it on its own (not against other options)."""
    kind = _KINDS[name]
    value = raw
    if isinstance(raw, str) and (from_text or kind not in ("str", "optional_str")):
        try:
            value = _parse_text(kind, raw)
        except ValueError:
            raise ValueError(
                f"{source}: invalid value {raw!r} for option {name!r}: expected {_ALLOWED_TEXT[kind]}"
            ) from None
    try:
        return validate_option(name, value)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _unknown(what: str, name: str, candidates: list[str], *, quote: bool) -> ValueError:
    """Error for an unknown name, suggesting the nearest candidate (compared case-insensitively)."""
    by_folded = {c.casefold(): c for c in candidates}
    close = difflib.get_close_matches(name.casefold(), list(by_folded), n=1, cutoff=0.6)
    render = repr if quote else str
    hint = f"; did you mean {render(by_folded[close[0]])}?" if close else ""
    return ValueError(f"unknown {what} {render(name)}{hint} (valid: {', '.join(candidates)})")


def _code_only_error(name: str, source: str) -> ValueError:
    return ValueError(
        f"{source}: option {name!r} cannot be set from the environment or a file; pass a strategy object in "
        f"code, e.g. OffloadConfig({name}=flextensor.GreedyStrategy()) or load_config(..., {name}=...)"
    )


# --------------------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------------------


def _read_env(prefix: str, environ: Mapping[str, str]) -> dict[str, _Value]:
    values: dict[str, _Value] = {}
    for var in sorted(environ):
        if not var.startswith(prefix):
            continue
        suffix = var[len(prefix) :]
        if suffix in FOREIGN_ENV_NAMES or suffix.startswith(FOREIGN_ENV_PREFIXES):
            continue
        name = suffix.lower()
        source = f"environment variable {var}"
        if name in _CODE_ONLY:
            raise _code_only_error(name, source)
        if name not in _KINDS or suffix != name.upper():
            raise _unknown("environment variable", var, [prefix + n.upper() for n in _KINDS], quote=False)
        values[name] = _Value(_convert(name, environ[var], source, from_text=True), source)
    return values


def _read_mapping(data: Mapping[Any, Any], source: str, *, from_text: bool) -> dict[str, _Value]:
    values: dict[str, _Value] = {}
    for key, raw in data.items():
        if not isinstance(key, str):
            raise ValueError(f"{source}: option names must be strings, got {key!r}")
        if key in _CODE_ONLY:
            raise _code_only_error(key, source)
        if key not in _KINDS:
            raise ValueError(f"{source}: {_unknown('option', key, list(_KINDS), quote=True)}")
        values[key] = _Value(_convert(key, raw, source, from_text=from_text), source)
    return values


def _read_file(path: str | os.PathLike[str]) -> dict[str, _Value]:
    file = Path(path)
    source = f"file {file}"
    suffix = file.suffix.lower()
    known = _INI_SUFFIXES + _YAML_SUFFIXES + _JSON_SUFFIXES
    if suffix not in known:
        raise ValueError(
            f"{source}: cannot tell the format from the extension {suffix or '(none)'!r}; "
            f"use one of {', '.join(known)}"
        )
    if not file.is_file():
        raise FileNotFoundError(f"flextensor config file {file} does not exist (or is not a regular file)")
    text = file.read_text(encoding="utf-8")

    if suffix in _INI_SUFFIXES:
        # No interpolation: '%' may legitimately appear in globs and paths. Inline comments need a space
        # before ';' or '#', so patterns such as "a#b" survive.
        parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=(";", "#"))
        try:
            parser.read_string(text, source=str(file))
        except configparser.Error as exc:
            raise ValueError(f"{source}: not a valid INI file: {exc}") from None
        if not parser.has_section(INI_SECTION):
            raise ValueError(
                f"{source}: missing section [{INI_SECTION}]; put the options under a '[{INI_SECTION}]' line "
                f"(sections found: {parser.sections() or 'none'})"
            )
        return _read_mapping(dict(parser.items(INI_SECTION)), source, from_text=True)

    if suffix in _YAML_SUFFIXES:
        return _read_mapping(yaml_mapping(text, source), source, from_text=False)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON: {exc}") from None
    if data is None:
        data = {}  # an empty file is an empty configuration
    if not isinstance(data, dict):
        raise ValueError(f"{source}: the top level must be a mapping of names to values, got {type(data).__name__}")
    return _read_mapping(data, source, from_text=False)


# --------------------------------------------------------------------------------------------------------------
# Assembly
# --------------------------------------------------------------------------------------------------------------


def _build(
    layers: list[dict[str, _Value]], kwargs: Mapping[str, Any], defaults: Mapping[str, Any]
) -> OffloadConfig:
    """Merge lowest-to-highest layers, apply kwargs, build; name sources when a cross-option check fails."""
    unknown = [k for k in kwargs if k not in OffloadConfig.field_names()]
    if unknown:
        close = difflib.get_close_matches(unknown[0], OffloadConfig.field_names(), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"load_config() got an unexpected keyword argument {unknown[0]!r}{hint}")
    merged: dict[str, _Value] = {name: _Value(value, "default") for name, value in defaults.items()}
    for layer in layers:
        merged.update(layer)
    merged.update({name: _Value(value, "keyword argument") for name, value in kwargs.items()})
    try:
        return OffloadConfig(**{name: v.value for name, v in merged.items()})
    except ValueError as exc:
        involved = [
            f"{name} from {v.source}"
            for name, v in merged.items()
            if v.source not in ("default", "keyword argument") and re.search(rf"\b{name}\b", str(exc))
        ]
        if not involved:
            raise
        raise ValueError(f"{exc} (values from: {'; '.join(involved)})") from None


def load_config_from_env(prefix: str = ENV_PREFIX) -> OffloadConfig:
    """Config from ``{prefix}*`` environment variables over the defaults; ``enabled`` defaults to ``False``."""
    return _build([_read_env(prefix, os.environ)], {}, {"enabled": False})


def load_config_from_file(path: str | os.PathLike[str]) -> OffloadConfig:
    """Config from one INI (``[flextensor]`` section), YAML or JSON file over the defaults; no environment."""
    return _build([_read_file(path)], {}, {})


def load_config(
    config_path: str | os.PathLike[str] | None = None, use_env: bool = True, **kwargs: Any
) -> OffloadConfig:
    """Combine file, ``FT_*`` environment and keyword arguments (kwargs > env > file > defaults).

    Without a file and with ``use_env=True`` this is environment-only loading, so ``enabled`` defaults to
    ``False`` unless ``FT_ENABLED`` (or ``enabled=`` here) says otherwise. ``load_strategy`` can only come
    from ``kwargs``.
    """
    layers: list[dict[str, _Value]] = []
    defaults: dict[str, Any] = {}
    if config_path is not None:
        layers.append(_read_file(config_path))
    if use_env:
        layers.append(_read_env(ENV_PREFIX, os.environ))
        if config_path is None:
            defaults["enabled"] = False
    config = _build(layers, kwargs, defaults)
    logger.debug(
        "loaded flextensor config (file=%s, env=%s, kwargs=%s): %s",
        config_path,
        use_env,
        sorted(kwargs),
        config.to_dict(),
    )
    return config
