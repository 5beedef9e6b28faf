//! `kvsnap chat`: `kvsnap call` over utterances read from stdin, one per line, with the catalog
//! prefix prefilled before the first line is read.
//!
//! Lines starting with `:` are commands: `:catalog FILE` switches to another catalog (its prefix
//! is cached next to the others, within the cache budget), `:stats` prints the cache counters,
//! `:quit` ends (so does the end of input).

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;

use kvsnap_contract::KvModel;
use kvsnap_prompt::{Catalog, Tokenizer, ToolCaller};

use super::backend::with_model;
use super::call::{
    load_inputs, loading, print_summary, print_turn, progress_printer, start, warm, ServeArgs,
};

/// Arguments of `kvsnap chat`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// Runs `kvsnap chat`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let (catalog, tokenizer) = load_inputs(&args.serve)?;
    let t = loading(&args.serve);
    with_model!(args.serve.backend, &args.serve.model, |m| {
        eprintln!("loaded in {:.2} s", t.elapsed().as_secs_f64());
        serve(m, &args.serve, tokenizer, catalog)
    })
}

fn serve<M: KvModel>(
    model: &M,
    args: &ServeArgs,
    tokenizer: Tokenizer,
    mut catalog: Catalog,
) -> anyhow::Result<ExitCode> {
    let mut caller = start(model, args, tokenizer, &catalog)?;
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("type an utterance per line (:catalog FILE, :stats, :quit; Ctrl-D ends)");
    }
    let mut latencies = Vec::new();
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(command) = line.strip_prefix(':') {
            match command.split_once(' ').unwrap_or((command, "")) {
                ("quit", _) | ("q", _) => break,
                ("stats", _) => print_summary(&caller, &latencies),
                ("catalog", file) if !file.trim().is_empty() => {
                    match switch(&mut caller, Path::new(file.trim())) {
                        Ok(next) => catalog = next,
                        // A bad catalog file is the user's typo, not the end of the session.
                        Err(e) => eprintln!("error: {e:#}"),
                    }
                }
                _ => eprintln!("unknown command `{line}` (:catalog FILE, :stats, :quit)"),
            }
            continue;
        }
        match caller.call(&catalog, line, &mut progress_printer()) {
            Ok(out) => latencies.push(print_turn(&caller, latencies.len() + 1, line, &out)),
            // An utterance the prompt cannot hold is reported and skipped; model failures end.
            Err(e @ kvsnap_prompt::Error::Utterance { .. }) => eprintln!("error: {e}"),
            Err(e) => return Err(e.into()),
        }
    }
    print_summary(&caller, &latencies);
    Ok(ExitCode::SUCCESS)
}

/// Loads `file` and caches its prefix.
fn switch<M: KvModel>(caller: &mut ToolCaller<'_, M>, file: &Path) -> anyhow::Result<Catalog> {
    let catalog = Catalog::from_file(file)?;
    println!(
        "catalog {}: {} functions",
        file.display(),
        catalog.functions.len()
    );
    warm(caller, &catalog)?;
    Ok(catalog)
}
