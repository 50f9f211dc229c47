"""Schema 1: environments, specs, flashgen's trials and best configs (flashgen 0.1.0).

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("flashgen_meta", sa.Column("key", sa.String(64), primary_key=True),
                    sa.Column("value", sa.String(256), nullable=False))
    op.create_table(
        "environments", sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("gpu", sa.String(128), nullable=False), sa.Column("capability", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer, nullable=False), sa.Column("memory_gib", sa.Float, nullable=False),
        sa.Column("torch", sa.String(64), nullable=False), sa.Column("triton", sa.String(64), nullable=False),
        sa.Column("cuda", sa.String(32), nullable=False), sa.Column("flashgen", sa.String(32), nullable=False),
        sa.Column("templates", sa.String(32), nullable=False),
        sa.UniqueConstraint("gpu", "capability", "sm_count", "memory_gib", "torch", "triton", "cuda", "flashgen",
                            "templates", name="uq_environment"))
    op.create_table("specs", sa.Column("id", sa.Integer, primary_key=True),
                    sa.Column("key", sa.String(32), nullable=False, unique=True),
                    sa.Column("uri", sa.String(256), nullable=False), sa.Column("canonical", sa.JSON, nullable=False))
    for table, extra, unique in (
            ("trials", [sa.Column("config_key", sa.String(32), nullable=False),
                        sa.Column("config", sa.JSON, nullable=False), sa.Column("status", sa.String(24), nullable=False),
                        sa.Column("ms", sa.Float), sa.Column("tflops", sa.Float), sa.Column("margin", sa.Float),
                        sa.Column("error", sa.Text)], ("config_key",)),
            ("best_configs", [sa.Column("config", sa.JSON, nullable=False), sa.Column("ms", sa.Float, nullable=False),
                              sa.Column("tflops", sa.Float, nullable=False), sa.Column("default_ms", sa.Float)], ())):
        op.create_table(
            table, sa.Column("id", sa.Integer, primary_key=True),
            sa.Column("environment_id", sa.Integer, sa.ForeignKey("environments.id"), nullable=False),
            sa.Column("spec_id", sa.Integer, sa.ForeignKey("specs.id"), nullable=False),
            sa.Column("bucket", sa.Integer, nullable=False), sa.Column("phase", sa.String(8), nullable=False),
            *extra, sa.Column("created", sa.DateTime(timezone=True), nullable=False),
            sa.UniqueConstraint("environment_id", "spec_id", "bucket", "phase", *unique,
                                name="uq_trial" if table == "trials" else "uq_best"))
    op.execute("INSERT INTO flashgen_meta (key, value) VALUES ('schema_version', '1')")


def downgrade():
    for table in ("best_configs", "trials", "specs", "environments", "flashgen_meta"):
        op.drop_table(table)
