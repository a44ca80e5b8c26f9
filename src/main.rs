//! The `chat-history` binary: look at the environment, parse the
//! configuration, start logging, run the chosen subcommand.

use std::process::ExitCode;

use clap::Parser;

use chat_history::config::{check_environment, environment_source, Cli, Command};
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
    telemetry::init(cli.config.log_format);
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    let runtime = match tokio::runtime::Runtime::new() {
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
