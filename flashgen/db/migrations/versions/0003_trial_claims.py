"""Schema 3: trial_claims, which worker is measuring which config of a study.

Workers that share a study (several GPUs, several hosts) claim a config here before they
measure it: the first insert wins, so no config is measured twice at once; a claim whose
trial Optuna's heartbeat has failed (its worker died) passes to the trial that retries it.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("trial_claims", sa.Column("study", sa.String(512), primary_key=True),
                    sa.Column("config_key", sa.String(32), primary_key=True),
                    sa.Column("trial_id", sa.Integer, nullable=False))
    op.execute("UPDATE flashgen_meta SET value = '3' WHERE key = 'schema_version'")


def downgrade():
    op.drop_table("trial_claims")
    op.execute("UPDATE flashgen_meta SET value = '2' WHERE key = 'schema_version'")
