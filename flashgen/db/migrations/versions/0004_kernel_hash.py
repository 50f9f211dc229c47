"""Schema 4: each best config stores the hash of the kernels it was timed on.

``best_configs.kernel`` (flashgen.codegen.render.kernel_hash of the result's spec, config
and phase): a result serves while flashgen renders the same kernels for it, so a template
change that leaves a spec's kernels alone no longer drops its tuned results. The migration
fills what it can tell: a result whose environment has the templates hash of the flashgen
running the migration was timed on the kernels it renders now, so it gets their hash. The
others keep NULL and are judged by their templates hash, as before.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade():
    from flashgen.db.kernels import fill_kernel_hashes

    with op.batch_alter_table("best_configs") as batch:
        batch.add_column(sa.Column("kernel", sa.String(32), nullable=True))
    fill_kernel_hashes(op.get_bind())
    op.execute("UPDATE flashgen_meta SET value = '4' WHERE key = 'schema_version'")


def downgrade():
    with op.batch_alter_table("best_configs") as batch:
        batch.drop_column("kernel")
    op.execute("UPDATE flashgen_meta SET value = '3' WHERE key = 'schema_version'")
