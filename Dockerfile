# chat-history: a multi-stage build of the release binary, run as a non-root
# user from a small Debian image. Build: docker build -t chat-history .

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
RUN cargo build --release --locked --bin chat-history

FROM debian:bookworm-slim
RUN groupadd --system --gid 10001 chat-history \
    && useradd --system --uid 10001 --gid 10001 --home-dir /data --create-home chat-history
COPY --from=build /src/target/release/chat-history /usr/local/bin/chat-history
USER 10001:10001
WORKDIR /data
# Inside the container the service listens on every address; with no API
# keys it refuses to start unless CHAT_HISTORY_ALLOW_UNAUTHENTICATED=true.
ENV CHAT_HISTORY_BIND=0.0.0.0:8080 \
    DATABASE_URL=sqlite:///data/chat-history.db \
    CHAT_HISTORY_LOG_FORMAT=json
VOLUME ["/data"]
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["chat-history", "healthcheck"]
ENTRYPOINT ["chat-history"]
CMD ["serve"]
