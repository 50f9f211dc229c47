"""Database URLs as flashgen shows them: never with a password, and SQLite files as paths.

Every message that names a database (warnings, errors, CLI output, reprs) goes through
``display_url`` or ``hide_password``: a URL such as ``postgresql://admin:S3cret@host/db``
is written ``postgresql://admin:***@host/db``.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sqlalchemy.engine import make_url

# user:password@ in a URL that SQLAlchemy cannot parse (a bad port, say); greedy up to the
# last '@', so a password holding '@' is hidden whole.
_PASSWORD_RE = re.compile(r"(://[^:/@]*):(.*)@")


def display_url(url: str) -> str:
    """The URL with its password replaced by *** (a URL without one is shown as given)."""
    try:
        parsed = make_url(url)
        return url if parsed.password is None else parsed.render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 (unparsable: hide by pattern, still never show it)
        return _PASSWORD_RE.sub(r"\1:***@", url)


def _passwords(url: str) -> set[str]:
    found = set()
    match = _PASSWORD_RE.search(url)
    if match and match.group(2):
        found |= {match.group(2), unquote(match.group(2))}
    try:
        password = make_url(url).password
    except Exception:  # noqa: BLE001
        password = None
    if password:
        found.add(str(password))
    return found


def hide_password(text: str, url: str | None) -> str:
    """text with the URL shown as display_url and its password (raw or %-decoded) as ***
    wherever it stands as a whole token (a driver's message may quote it: ``password=...``,
    ``user:...@``); not inside other words, which a short or common password would garble
    (``e`` in every "error", ``postgres`` in "postgresql")."""
    if not url:
        return text
    text = text.replace(url, display_url(url))
    for secret in sorted(_passwords(url), key=len, reverse=True):
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", "***", text)
    return text


def sqlite_file(url: str) -> Path | None:
    """The file an SQLite URL names (``file:`` URIs included); None for other databases and
    for in-memory SQLite."""
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 (not a URL: not a file either)
        return None
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    database = parsed.database
    if database.startswith("file:") and str(parsed.query.get("uri", "")).lower() in ("true", "1"):
        if str(parsed.query.get("mode", "")) == "memory":
            return None
        database = unquote(urlsplit(database).path)
    return Path(database).expanduser()


def expanded_url(url: str) -> str:
    """An SQLite URL whose file path starts with ``~`` with the user's home put in, as every path flashgen shows
    and checks has it (SQLite itself would open a folder named ``~`` in the working directory); other URLs as
    given."""
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 (not a URL: its opening names the problem)
        return url
    if parsed.get_backend_name() != "sqlite" or not (parsed.database or "").startswith("~"):
        return url
    return parsed.set(database=str(Path(parsed.database).expanduser())).render_as_string(hide_password=False)


def in_memory(url: str) -> bool:
    """Whether url names an in-memory SQLite database (gone when its process ends)."""
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 (not a URL: its opening names the problem)
        return False
    return parsed.get_backend_name() == "sqlite" and sqlite_file(url) is None


CONNECT_TIMEOUT_S = 10  # a database server that accepts a connection but never answers: an error after this long


def engine_options(url: str) -> dict:
    """create_engine's keyword arguments beyond the URL: a connect timeout for a server's database
    (PostgreSQL, MySQL: without one a server that accepts the connection and never answers hangs
    every flashgen call that reads it), unless the URL sets its own (``?connect_timeout=``)."""
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 (not a URL: its opening names the problem)
        return {}
    if parsed.get_backend_name() in ("postgresql", "mysql", "mariadb") and "connect_timeout" not in parsed.query:
        return {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    return {}

