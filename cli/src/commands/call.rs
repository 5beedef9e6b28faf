//! `kvsnap call`: utterances in, FunctionGemma function calls out, each served from the catalog
//! prefix that was prefilled once.
//!
//! stdout gets, per utterance, the decoded output, the parsed call (or why it is not one) and
//! the turn's timings next to the stateless cost it avoided; stderr gets the progress of loading
//! the model and prefilling the prefix.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use kvsnap_contract::KvModel;
use kvsnap_prompt::{
    stateless_estimate_s, CallOutcome, Catalog, Lookup, PrefillProgress, Tokenizer, ToolCaller,
};

use super::backend::{with_model, Backend};

/// Model, backend and generation options shared by `kvsnap call` and `kvsnap chat`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// Model directory in Hugging Face format (config.json, model.safetensors, tokenizer.json):
    /// the base Gemma 3 270M from `kvsnap fetch-model`, or a FunctionGemma checkpoint.
    #[arg(long, default_value = "models/gemma-3-270m")]
    pub model: PathBuf,
    /// Backend to run.
    #[arg(long, default_value_t = Backend::Reference)]
    pub backend: Backend,
    /// Catalog of callable functions (JSON: {"functions": [{name, description, parameters,
    /// required}]}), e.g. examples/tv-catalog.json.
    #[arg(long)]
    pub catalog: PathBuf,
    /// Most tokens generated per utterance.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Tokens per prefill call while a catalog prefix is computed (progress is reported per
    /// chunk).
    #[arg(long, default_value_t = kvsnap_prompt::DEFAULT_CHUNK)]
    pub prefill_chunk: usize,
    /// Memory for cached catalog prefixes, in MiB (least recently used catalogs are evicted).
    #[arg(long, default_value_t = 256)]
    pub cache_mib: u64,
}

/// Arguments of `kvsnap call`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Utterances to turn into function calls, one argument each.
    #[arg(required = true)]
    pub utterances: Vec<String>,
}

/// Runs `kvsnap call`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let (catalog, tokenizer) = load_inputs(&args.serve)?;
    let t = loading(&args.serve);
    with_model!(args.serve.backend, &args.serve.model, |m| {
        eprintln!("loaded in {:.2} s", t.elapsed().as_secs_f64());
        serve(m, &args, tokenizer, &catalog)
    })
}

fn serve<M: KvModel>(
    model: &M,
    args: &Args,
    tokenizer: Tokenizer,
    catalog: &Catalog,
) -> anyhow::Result<ExitCode> {
    let mut caller = start(model, &args.serve, tokenizer, catalog)?;
    let mut latencies = Vec::new();
    for (i, utterance) in args.utterances.iter().enumerate() {
        let out = caller.call(catalog, utterance, &mut progress_printer())?;
        latencies.push(print_turn(&caller, i + 1, utterance, &out));
    }
    print_summary(&caller, &latencies);
    Ok(ExitCode::SUCCESS)
}

/// The catalog and the tokenizer, checked before the (slower) model load.
pub(super) fn load_inputs(args: &ServeArgs) -> anyhow::Result<(Catalog, Tokenizer)> {
    let catalog = Catalog::from_file(&args.catalog)?;
    let tokenizer = Tokenizer::load(&args.model).with_context(|| {
        format!(
            "loading the tokenizer of {} (is it a model directory?)",
            args.model.display()
        )
    })?;
    Ok((catalog, tokenizer))
}

/// Says on stderr that the model is loading; returns the start time.
pub(super) fn loading(args: &ServeArgs) -> Instant {
    eprintln!(
        "loading {} on the {} backend ...",
        args.model.display(),
        args.backend
    );
    Instant::now()
}

/// A caller over `model` with the catalog's prefix already cached.
pub(super) fn start<'m, M: KvModel>(
    model: &'m M,
    args: &ServeArgs,
    tokenizer: Tokenizer,
    catalog: &Catalog,
) -> anyhow::Result<ToolCaller<'m, M>> {
    let mut caller = ToolCaller::new(model, tokenizer, args.cache_mib << 20, args.max_new_tokens)?
        .with_prefill_chunk(args.prefill_chunk);
    println!(
        "catalog {}: {} functions; backend {}, at most {} new tokens per utterance",
        args.catalog.display(),
        catalog.functions.len(),
        model.backend(),
        args.max_new_tokens
    );
    warm(&mut caller, catalog)?;
    Ok(caller)
}

/// Caches `catalog`'s prefix and says what it cost.
pub(super) fn warm<M: KvModel>(
    caller: &mut ToolCaller<'_, M>,
    catalog: &Catalog,
) -> anyhow::Result<()> {
    let before = caller.cache().stats();
    let lookup = caller.warm(catalog, &mut progress_printer())?;
    let after = caller.cache().stats();
    let prefix_len = caller.prefix_ids(catalog)?.0.len();
    let computed = after.prefilled_tokens - before.prefilled_tokens;
    let seconds = after.prefill_s - before.prefill_s;
    let how = match lookup {
        Lookup::Hit => "already cached".to_string(),
        Lookup::Miss => format!(
            "prefilled once in {seconds:.2} s ({:.0} tok/s)",
            computed as f64 / seconds
        ),
        Lookup::Extended { reused } => format!(
            "{reused} tokens reused from a cached catalog, {computed} prefilled in {seconds:.2} s"
        ),
    };
    let held_back = match caller.held_back() {
        0 => String::new(),
        n => format!(
            " (+{n} sent with each turn: it tokenizes differently when declarations follow)"
        ),
    };
    println!(
        "catalog prefix: {prefix_len} tokens{held_back}, {how}; {:.1} MiB of KV cached",
        after.bytes as f64 / MIB
    );
    Ok(())
}

const MIB: f64 = (1u64 << 20) as f64;

/// Reports prefill progress on stderr: one updating line on a terminal, a final line otherwise.
pub(super) fn progress_printer() -> impl FnMut(PrefillProgress) {
    let terminal = std::io::stderr().is_terminal();
    let t = Instant::now();
    move |p: PrefillProgress| {
        if terminal {
            eprint!(
                "\rprefilling the catalog prefix: {}/{} tokens",
                p.done, p.total
            );
            if p.done == p.total {
                eprintln!(" ({:.2} s)", t.elapsed().as_secs_f64());
            }
            let _ = std::io::stderr().flush();
        } else if p.done == p.total {
            eprintln!(
                "prefilled the catalog prefix up to {} tokens in {:.2} s",
                p.total,
                t.elapsed().as_secs_f64()
            );
        }
    }
}

/// Prints one turn; returns its latency in seconds.
pub(super) fn print_turn<M: KvModel>(
    caller: &ToolCaller<'_, M>,
    index: usize,
    utterance: &str,
    out: &CallOutcome,
) -> f64 {
    let turn = &out.turn;
    let t = &turn.timings;
    println!("[{index}] {utterance:?}");
    println!("  output     {}", turn.text.replace('\n', "\\n"));
    match &out.call {
        Ok(call) if out.problems.is_empty() => println!("  call       {call}"),
        Ok(call) => {
            let problems: Vec<String> = out.problems.iter().map(|p| p.to_string()).collect();
            println!(
                "  call       {call} (does not fit the catalog: {})",
                problems.join("; ")
            )
        }
        Err(why) => println!("  call       none: {why}"),
    }
    println!(
        "  stopped    {} after {} tokens",
        turn.stop,
        turn.generated.len()
    );
    match t.lookup {
        Lookup::Hit => {}
        Lookup::Miss | Lookup::Extended { .. } => println!(
            "  prefix     not cached yet: prefilled {} tokens in {:.2} s (once per catalog)",
            t.prefix_prefilled, t.prefix_prefill_s
        ),
    }
    let latency = t.latency_s();
    println!(
        "  latency    {:.3} s = restore {:.1} ms + utterance {} tokens {:.3} s + {} steps {:.3} s ({:.1} tok/s)",
        latency,
        t.restore_s * 1e3,
        turn.turn_len,
        t.extend_s,
        t.steps,
        t.decode_s,
        t.steps as f64 / t.decode_s.max(1e-9)
    );
    if let Some(rate) = caller.cache().stats().prefill_rate() {
        let stateless = stateless_estimate_s(turn.prompt_len(), turn.generated.len(), rate);
        println!(
            "  stateless  ~{:.1} s (estimate: each of the {} tokens re-prefills the whole {}+ token sequence at the measured {:.0} tok/s), {:.0}x this turn",
            stateless,
            turn.generated.len(),
            turn.prompt_len(),
            rate,
            stateless / latency.max(1e-9)
        );
    }
    latency
}

/// Prints the latency distribution and the cache counters.
pub(super) fn print_summary<M: KvModel>(caller: &ToolCaller<'_, M>, latencies: &[f64]) {
    let s = caller.cache().stats();
    if !latencies.is_empty() {
        let mut sorted = latencies.to_vec();
        sorted.sort_by(f64::total_cmp);
        println!(
            "{} turns: latency p50 {:.3} s, max {:.3} s (the prefix prefill is not in it: it is paid once per catalog)",
            sorted.len(),
            sorted[sorted.len() / 2],
            sorted[sorted.len() - 1]
        );
    }
    println!(
        "prefix cache: {} hits, {} misses, {} extended, {} evictions; {} entries, {:.1} of {:.0} MiB",
        s.hits,
        s.misses,
        s.extended,
        s.evictions,
        s.entries,
        s.bytes as f64 / MIB,
        s.budget as f64 / MIB
    );
}
