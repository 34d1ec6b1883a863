"""Dashboard sessions kept on the server: a logout ends them, and the database holds only a
hash of each session's token (sessions were signed with the key's stored hash before, which
whoever read the database could sign with too).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 09:00:00
"""

from alembic import op
import sqlalchemy as sa


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'dashboard_sessions',
        sa.Column('token_hash', sa.String(length=64), nullable=False),
        sa.Column('key_id', sa.String(length=32), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['key_id'], ['api_keys.id']),
        sa.PrimaryKeyConstraint('token_hash'),
    )
    op.create_index('ix_dashboard_sessions_key_id', 'dashboard_sessions', ['key_id'])
    op.create_index('ix_dashboard_sessions_expires_at', 'dashboard_sessions', ['expires_at'])


def downgrade() -> None:
    op.drop_index('ix_dashboard_sessions_expires_at', table_name='dashboard_sessions')
    op.drop_index('ix_dashboard_sessions_key_id', table_name='dashboard_sessions')
    op.drop_table('dashboard_sessions')
