# chat-history: a multi-stage build of the release binary, run as the non-root
# uid 10001 on a minimal base (glibc and libgcc_s: no shell, no package
# manager). Build (BuildKit, Docker's default builder): docker build -t chat-history .
#
# Build arguments, for machines without a registry (scripts/image-test makes
# local equivalents from Debian packages and passes them):
#   RUST_IMAGE     the build stage: Rust >= rust-version, gcc and libc6-dev
#   RUNTIME_IMAGE  the runtime stage: glibc and libgcc_s, with PATH set
#   CARGO_VENDOR   "true": build offline from the crates in target/image/vendor
#                  (cargo vendor --locked target/image/vendor)
ARG RUST_IMAGE=rust:1.95-slim-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${RUST_IMAGE} AS build
ARG CARGO_VENDOR=false
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
# The pattern matches nothing when nothing was vendored: then this copies
# nothing, and the crates come from crates.io.
COPY targe[t]/image/vendor ./vendor/
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
# target/ lives in a cache mount: after a source change only the crate itself
# is compiled again.
RUN --mount=type=cache,target=/src/target,id=chat-history-target,sharing=locked \
    if [ "$CARGO_VENDOR" = true ]; then \
        set -- --offline \
            --config 'source.crates-io.replace-with="vendored"' \
            --config 'source.vendored.directory="vendor"'; \
    fi \
    && cargo build --release --locked "$@" --bin chat-history \
    && mkdir -p /out/data \
    && cp target/release/chat-history /out/chat-history

# No RUN from here on: the runtime image needs no shell.
FROM ${RUNTIME_IMAGE}
COPY --from=build /out/chat-history /usr/local/bin/chat-history
COPY --from=build --chown=10001:10001 /out/data /data
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
