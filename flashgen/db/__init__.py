"""The tuning results: a SQLAlchemy database (the user's), over the read-only layer shipped
in tuning_db/."""

from .env import EXACT, NEAR, EnvInfo
from .models import SCHEMA_VERSION
from .rows import ResultRowError
from .store import (DatabaseError, MissingDatabaseError, ResultStore, SchemaVersionError, TrialRecord, config_key,
                    default_url)
from .urls import display_url, hide_password

__all__ = ["EXACT", "NEAR", "SCHEMA_VERSION", "DatabaseError", "EnvInfo", "MissingDatabaseError", "ResultRowError",
           "ResultStore", "SchemaVersionError", "TrialRecord", "config_key", "default_url", "display_url",
           "hide_password"]
