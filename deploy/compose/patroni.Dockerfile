# PostgreSQL 15 with Patroni (Debian's package, as ./dev installs it) for the `ha` profile.
FROM postgres:15
RUN apt-get update && apt-get install -y --no-install-recommends patroni && rm -rf /var/lib/apt/lists/*
USER postgres
ENTRYPOINT ["patroni", "/etc/patroni.yml"]
