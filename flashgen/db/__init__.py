"""The tuning results: a SQLAlchemy database (the user's), over the read-only layer shipped
in tuning_db/."""

from .models import SCHEMA_VERSION
from .store import EnvInfo, ResultStore, SchemaVersionError, TrialRecord, config_key, default_url

__all__ = ["SCHEMA_VERSION", "EnvInfo", "ResultStore", "SchemaVersionError", "TrialRecord", "config_key",
           "default_url"]
