"""The control plane (`stasis controlplane ...`): one self-hosted service where clusters and their
nodes register, with an admin API and CLI. It owns its database (SQLite by default, PostgreSQL by
URL; Alembic migrations at start), the tokens (admin and per cluster, stored hashed), and the
node side: the daemon integration that joins a node to it (connecting out, never listening).

It never imports another integration; node daemons reach it only over HTTP.
"""
