"""Alembic's entry point for flashgen's migrations: run on the connection flashgen.db.migrate
hands over (never from alembic.ini or a URL), with flashgen's own version table, so that
Optuna's tables and Optuna's own alembic_version in the same database are left alone."""

from alembic import context

from flashgen.db.migrate import VERSION_TABLE

connection = context.config.attributes["connection"]
context.configure(connection=connection, version_table=VERSION_TABLE, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
