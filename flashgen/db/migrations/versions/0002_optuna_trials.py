"""Schema 2: Optuna's RDB storage holds the studies and trials; flashgen's trials table goes.

Optuna's own table is also called ``trials``, so flashgen's must leave that name: an empty
one is dropped, one holding results of schema 1 is kept as ``flashgen_trials_v1`` (nothing
reads it; its best configs stay in best_configs, which is unchanged).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade():
    conn = op.get_bind()
    if conn.execute(sa.text("SELECT COUNT(*) FROM trials")).scalar():
        op.rename_table("trials", "flashgen_trials_v1")
    else:
        op.drop_table("trials")
    op.execute("UPDATE flashgen_meta SET value = '2' WHERE key = 'schema_version'")


def downgrade():
    raise NotImplementedError("flashgen does not go back to schema 1: its trials now live in Optuna's tables")
