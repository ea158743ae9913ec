#!/bin/sh
# Runs once, when the primary's data directory is created: allow streaming replication
# and create one physical slot per replica (before they take their base backups).
set -e
echo "host replication all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d postgres <<SQL
SELECT pg_create_physical_replication_slot('r1', true);
SELECT pg_create_physical_replication_slot('r2', true);
CREATE DATABASE stockgate;
SQL
