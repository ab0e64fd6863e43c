"""Every option of a serving role from the environment: `--max-model-len` <- `SCD_MAX_MODEL_LEN`.

Containers pass settings as environment variables, so each option of `prefill`, `decode`,
`gateway` and `up` defaults to `SCD_<OPTION>` (dashes as underscores) when set; a flag on
the command line still wins. Values go through the option's own type and choices, so a bad
one is refused at start, naming the variable. Lists split on commas or spaces; switches
take 1/0, true/false, yes/no, on/off.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from scd_serve.errors import ConfigError

PREFIX = "SCD_"
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
EPILOG = ("Every option can also be set by an environment variable SCD_<OPTION>, e.g. --max-model-len by "
          "SCD_MAX_MODEL_LEN; a flag on the command line wins.")


def env_name(action: argparse.Action) -> str:
    return PREFIX + action.dest.upper()


def _option(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _parse(action: argparse.Action, raw: str):
    name = env_name(action)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        word = raw.strip().lower()
        if word not in TRUE | FALSE:
            raise ConfigError(f"{name}={raw!r}: {_option(action)} is a switch; use 1/0, true/false, yes/no")
        return (word in TRUE) == isinstance(action, argparse._StoreTrueAction)
    words = raw.replace(",", " ").split() if action.nargs in ("+", "*") else [raw.strip()]
    convert = action.type or str
    try:
        values = [convert(w) for w in words]
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        kind = getattr(convert, "__name__", "value")
        raise ConfigError(f"{name}={raw!r}: {_option(action)} expects {kind} ({exc})") from None
    for v in values:
        if action.choices is not None and v not in action.choices:
            raise ConfigError(f"{name}={raw!r}: {_option(action)} must be one of {', '.join(map(str, action.choices))}")
    if action.nargs in ("+", "*"):
        if action.nargs == "+" and not values:
            raise ConfigError(f"{name} is empty: {_option(action)} needs at least one value")
        return values
    return values[0]


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> dict:
    """Set each option's default from its SCD_* variable, where set; returns {dest: value} applied."""
    environ = os.environ if environ is None else environ
    applied = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        raw = environ.get(env_name(action))
        if raw is None:
            continue
        applied[action.dest] = action.default = _parse(action, raw)
    parser.epilog = EPILOG
    return applied
