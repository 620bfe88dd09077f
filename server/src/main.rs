//! `kvtier`: the KV-cache block store sidecar.
//!
//! `kvtier serve` starts the block API on one port (HTTP/2 with prior
//! knowledge and HTTP/1.1); `kvtier info` describes a data directory.

mod cli;

use std::process::ExitCode;

use clap::Parser;

use cli::args::{Cli, Command};

// jemalloc with transparent huge pages, so the DMA buffers block reads land
// in are 2 MiB runs (why, and the figures: `kvtier_engine::alloc`).
kvtier_engine::jemalloc_with_huge_pages!();

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => cli::serve::serve(*args),
        Command::Info(args) => cli::inspect::info(&args.data_dirs),
        Command::Fsck(args) => match cli::inspect::fsck(&args) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::from(1),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtier: {e}");
            ExitCode::FAILURE
        }
    }
}
