//! The `chat-history` binary: look at the environment, parse the
//! configuration, start logging, run the chosen subcommand.

use std::process::ExitCode;

use clap::Parser;

use chat_history::config::{check_environment, environment_source, worker_threads, Cli, Command};
use chat_history::store::{
    certificate_file, unused_client_certificate, CLIENT_CERTIFICATE_VARIABLES,
};
use chat_history::{openapi_json, server, telemetry, transfer};

/// mimalloc: a request allocates and frees many small buffers from two
/// worker threads, which glibc's allocator served at about a tenth of the
/// CPU of a read.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // Before clap: a variable of ours that is not UTF-8 gets a message that
    // names it, and nothing else in the environment can stop start-up.
    let warnings = match check_environment(std::env::vars_os()) {
        Ok(warnings) => warnings,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            if let Some(variable) = environment_source(&error) {
                eprintln!("error: the environment variable {variable} holds a malformed value");
            }
            error.exit()
        }
    };
    let command = cli.command.clone().unwrap_or(Command::Serve);
    if matches!(command, Command::Openapi) {
        print!("{}", openapi_json());
        return ExitCode::SUCCESS;
    }
    // Before anything that could start a thread (the environment is not
    // to be changed while another thread may read it).
    let mut urls = vec![&cli.config.database_url];
    if let Command::Copy(copy) = &command {
        urls.extend([&copy.from, &copy.to]);
    }
    let certificate_warning =
        pass_over_an_unused_client_certificate(urls.iter().any(|u| u.names_client_certificate()));
    telemetry::init(cli.config.log_format);
    // The thread count is always given to tokio, which otherwise reads
    // TOKIO_WORKER_THREADS itself and panics on a value it cannot use.
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let (threads, threads_warning) = worker_threads(
        cli.config.worker_threads,
        std::env::var_os("TOKIO_WORKER_THREADS"),
        cpus,
    );
    for warning in warnings
        .into_iter()
        .chain(certificate_warning)
        .chain(threads_warning)
    {
        tracing::warn!("{warning}");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build();
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match command {
            Command::Migrate => server::migrate(cli.config).await,
            Command::Healthcheck => server::healthcheck(cli.config).await,
            Command::Copy(args) => transfer::run_copy(args, cli.config).await,
            Command::Export(args) => transfer::run_export(args, cli.config).await,
            Command::Import(args) => transfer::run_import(args, cli.config).await,
            Command::Serve | Command::Openapi => server::serve(cli.config).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The subscriber writes to stderr: this is the operator's message.
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// sqlx reads `PGSSLCERT` and `PGSSLKEY` and refuses every TLS connection
/// when they are a pair libpq would not use (see `unused_client_certificate`),
/// where libpq connects without a client certificate. Such a pair is taken
/// out of the environment, with a warning to log. Called before any thread
/// exists: `remove_var` is only sound while no other thread may read the
/// environment (edition 2024 makes it `unsafe` for that reason).
fn pass_over_an_unused_client_certificate(url_names_one: bool) -> Option<String> {
    let [cert, key] = CLIENT_CERTIFICATE_VARIABLES
        .map(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()));
    let warning = unused_client_certificate(
        cert.as_deref(),
        key.as_deref(),
        url_names_one,
        certificate_file,
    )?;
    for name in CLIENT_CERTIFICATE_VARIABLES {
        std::env::remove_var(name);
    }
    Some(warning)
}
