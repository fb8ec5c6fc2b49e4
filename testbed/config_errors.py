"""The bad-config check the config tests share: the ``ConfigError`` a job raises, and that it is one line."""

from __future__ import annotations

import pytest

from meshspeak.schema import ConfigError
from orchestrator.config.load import load_config


def error_for(*overrides: str, path: str | None = None) -> ConfigError:
    """The ``ConfigError`` that loading ``path`` with ``overrides`` raises (failing if none does); its
    message is one line, as the CLI prints it."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    err = info.value
    assert "\n" not in str(err)  # the CLI prints exactly one line
    return err
