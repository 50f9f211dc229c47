"""Schema 5: each best config records which default it was measured against.

``best_configs.default_kernel`` (flashgen.db.kernels.default_kernel: the kernel hash and the
phase's knobs of the heuristic default for the result's spec, bucket and phase, as the tuner
timed it in the same final round). The defaults move when the code changes (mask-aware, per
bucket); a result whose recorded default is no longer the current one is not served, so
flashgen.load never hands back a config that today's default may beat unseen. Rows stored
before this schema keep NULL: which default they beat is unknown (ARCHITECTURE.md says how
those are served; ``flashgen tune --recheck`` measures them against today's).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table("best_configs") as batch:
        batch.add_column(sa.Column("default_kernel", sa.String(32), nullable=True))
    op.execute("UPDATE flashgen_meta SET value = '5' WHERE key = 'schema_version'")


def downgrade():
    with op.batch_alter_table("best_configs") as batch:
        batch.drop_column("default_kernel")
    op.execute("UPDATE flashgen_meta SET value = '4' WHERE key = 'schema_version'")
