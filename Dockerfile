# syntax=docker/dockerfile:1
# shardline in a container: `docker build -t shardline:local .`
# Default command is a worker on every shard with the `log` handler; override the
# command with any subcommand (`topology apply`, `load ...`, `worker --assign 0-7 ...`).

FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# The cache mounts keep the registry and target between builds; the binary is copied
# out in the same step because the target mount is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p shardline \
    && install -D -m 0755 target/release/shardline /out/shardline

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 shardline \
    && useradd --system --uid 10001 --gid shardline --home-dir /nonexistent --shell /usr/sbin/nologin shardline
COPY --from=builder /out/shardline /usr/local/bin/shardline
USER 10001:10001
ENTRYPOINT ["/usr/local/bin/shardline"]
CMD ["worker", "--handler", "log"]
