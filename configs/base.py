"""The config base classes: frozen models, operational fields (never in a key), the error naming field and file."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

PRESETS_DIR = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A config file is invalid; the message names the file and the field."""


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def operational(default, **kwargs):
    """A field that changes how a stage runs or reports, never what it writes (logging cadence, alarms,
    peak FLOPs, checkpoint retention, world size): it is handed to the stage but kept out of its key."""
    return Field(default=default, json_schema_extra={"operational": True}, **kwargs)
