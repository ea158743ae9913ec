# Multi-stage build: compile in the Rust image, run in a slim Debian.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p stockgate

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/stockgate /usr/local/bin/stockgate
USER nobody
EXPOSE 8080
ENV STOCKGATE_LISTEN=0.0.0.0:8080
ENTRYPOINT ["stockgate"]
CMD ["serve"]
