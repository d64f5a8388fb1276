# copier-node: a small image that runs as a non-root user, migrations embedded in the binary.
#
#   docker build -t copier-node:0.1.0 .
#   docker run --rm -e DATABASE_URL=... copier-node:0.1.0 migrate
#   docker run --rm -e DATABASE_URL=... -e COPIER_PLATFORM=mt5 -p 9464:9464 copier-node:0.1.0 run

FROM rust:1.95-bookworm AS build
# cmake builds the QuickFIX C++ engine the FIX adapter binds (the `quickfix` crate); g++ is in the
# image already.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependencies first, so source edits do not rebuild them. Cargo reads every target the
# manifest declares, so the test and bench targets get empty stand-ins (never built here).
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src benches/copier tests/it && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs benches/copier/main.rs tests/it/main.rs \
    && cargo build --release --locked \
    && rm -rf src
COPY src ./src
COPY migrations ./migrations
COPY config ./config
RUN touch src/main.rs src/lib.rs && cargo build --release --locked \
    && strip target/release/copier-node

FROM debian:bookworm-slim
# ca-certificates is not pinned: it must follow the distribution's security updates, and a
# pinned version leaves the archive when the next one lands.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 copier \
    && useradd --system --uid 10001 --gid copier --no-create-home --shell /usr/sbin/nologin copier
COPY --from=build /src/target/release/copier-node /usr/local/bin/copier-node
COPY config/copier-node.example.toml /usr/share/copier-node/copier-node.example.toml
USER 10001:10001
EXPOSE 9464
ENTRYPOINT ["/usr/local/bin/copier-node"]
CMD ["run"]
