//! `kvtier-fuzz-targets`: with no arguments, prints the fuzz targets, one
//! per line: name, `-max_len` (bytes), `-malloc_limit_mb`, `-timeout` (s),
//! `-detect_leaks` (0 or 1), tab-separated (`fuzz/run.sh`, so `make fuzz`,
//! reads it, so the libFuzzer flags live in one place:
//! `kvtier_fuzz::TARGETS`). `kvtier-fuzz-targets run TARGET FILE...` runs
//! the target on each file, without a fuzzing engine: how a crash input is
//! reproduced and debugged (`KVTIER_FUZZ_TRACE=1` makes `store_ops` print
//! the store and operations it decoded).

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None => {
            for t in kvtier_fuzz::TARGETS {
                println!("{}\t{}\t{}\t{}\t{}", t.name, t.max_len, t.malloc_limit_mb, t.timeout_s, t.detect_leaks as u8);
            }
        }
        Some("run") if args.len() >= 3 => {
            let Some(target) = kvtier_fuzz::target(&args[1]) else {
                let names: Vec<&str> = kvtier_fuzz::TARGETS.iter().map(|t| t.name).collect();
                eprintln!("kvtier-fuzz-targets: no target {:?}; the targets: {}", args[1], names.join(", "));
                std::process::exit(2);
            };
            for file in &args[2..] {
                let data = std::fs::read(file).unwrap_or_else(|e| {
                    eprintln!("kvtier-fuzz-targets: reading {file}: {e}");
                    std::process::exit(2);
                });
                let started = std::time::Instant::now();
                (target.run)(&data);
                println!("{}: {file}: ok in {:.3} s", target.name, started.elapsed().as_secs_f64());
            }
        }
        _ => {
            eprintln!("usage: kvtier-fuzz-targets                 list the targets and their libFuzzer limits");
            eprintln!("       kvtier-fuzz-targets run TARGET FILE...  run TARGET on each input file");
            std::process::exit(2);
        }
    }
}
