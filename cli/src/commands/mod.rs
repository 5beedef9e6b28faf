//! One module per subcommand; each has clap `Args` and `run`.

pub mod backend;
pub mod bench;
pub mod call;
pub mod chat;
pub mod demo;
pub mod export;
pub mod fetch;
pub mod parity;
pub mod tiny;
