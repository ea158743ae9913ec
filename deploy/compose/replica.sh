#!/bin/sh
# A streaming hot-standby replica: on first start, take a base backup of the primary
# through this replica's slot (-R writes standby.signal and primary_conninfo), then run.
set -e
until pg_isready -h primary -U postgres -q; do sleep 1; done
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  PGPASSWORD="$POSTGRES_PASSWORD" pg_basebackup -h primary -U postgres -D "$PGDATA" -R -S "$SLOT" -c fast -X stream
  chmod 0700 "$PGDATA"
fi
exec postgres -c hot_standby=on -c hot_standby_feedback=off
