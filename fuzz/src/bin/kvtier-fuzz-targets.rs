//! Prints the fuzz targets, one per line: name, `-max_len` (bytes),
//! `-malloc_limit_mb`, `-timeout` (s), tab-separated. `fuzz/run.sh` (so
//! `make fuzz`) reads it, so the libFuzzer flags live in one place:
//! `kvtier_fuzz::TARGETS`.

fn main() {
    for t in kvtier_fuzz::TARGETS {
        println!("{}\t{}\t{}\t{}", t.name, t.max_len, t.malloc_limit_mb, t.timeout_s);
    }
}
