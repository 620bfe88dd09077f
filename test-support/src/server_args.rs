//! The command line of a test `kvtier serve`, written once: the server's
//! tests (`server/tests/common`, and through it the S3 tests, the crash and
//! soak harnesses and the supervisor tests) and the loadgen's
//! (`loadgen/tests/local.rs`, `route.rs`) all start from these, changing a flag with
//! [`set_flag`] or adding their own after.

use std::path::Path;

/// Block size of the test stores: 64 KiB keeps the tests fast.
pub const BLOCK_BYTES: u64 = 65_536;

/// `kvtier serve`'s flags for a test server but where it listens and its
/// data directory (which a harness's `server_process::Launcher` adds): a
/// store of 2 shards and [`BLOCK_BYTES`] blocks, 0.25 GiB of disk in 8 MiB
/// segments, no RAM tier; not pinned to CPUs (the tests share the
/// machine); warnings and errors logged only.
pub fn serve_flags() -> Vec<String> {
    let block_bytes = BLOCK_BYTES.to_string();
    [
        "--shards",
        "2",
        "--block-bytes",
        &block_bytes,
        "--disk-gb",
        "0.25",
        "--segment-mib",
        "8",
        "--pin-cpus",
        "false",
        // The least I/O memory (64 MiB a shard, faulted in and pinned at
        // each start): test servers come and go by the hundred, and 512 MiB
        // each kept the machine reclaiming memory under the tests.
        "--io-memory-mib",
        "128",
        "--log-level",
        "warn",
        "--ram-gb",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The standard test server: on an ephemeral loopback port
/// (`127.0.0.1:0`; the port is read from its "listening" line), over
/// `data_dir`, with [`serve_flags`]. `--listen` and its value come first.
pub fn test_args(data_dir: &Path) -> Vec<String> {
    let mut args = vec!["--listen".to_string(), "127.0.0.1:0".to_string(), "--data-dir".to_string(), path(data_dir)];
    args.extend(serve_flags());
    args
}

/// The flags of [`serve_flags`] that size the store.
pub const STORE_FLAGS: [&str; 5] = ["--shards", "--block-bytes", "--disk-gb", "--segment-mib", "--ram-gb"];

/// A test server on `listen` over `data_dir` whose store the server sizes
/// itself: [`test_args`] without [`STORE_FLAGS`], so its defaults choose
/// the shard count, the segment size from `--disk-gb`, or what the data
/// directory's `store.json` says on a reopen (for the tests of those
/// defaults; they add the flags they mean to set).
pub fn launch_args(listen: &str, data_dir: &Path) -> Vec<String> {
    let mut args = test_args(data_dir);
    set_flag(&mut args, "--listen", listen);
    for flag in STORE_FLAGS {
        if let Some(i) = args.iter().position(|a| a == flag) {
            args.drain(i..i + 2);
        }
    }
    args
}

/// Sets `flag`'s value in `args`: the word after it where it is there
/// already (as in [`test_args`]), else `flag value` appended.
pub fn set_flag(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) => args[i + 1] = value.to_string(),
        None => args.extend([flag.to_string(), value.to_string()]),
    }
}

fn path(p: &Path) -> String {
    p.to_str().expect("a test data directory's path is UTF-8").to_string()
}

/// The `kvtier` binary the tests start: `$KVTIER_BIN`, else the one cargo
/// built beside the calling test executable (`target/debug/deps/NAME-HASH`
/// → `target/debug/kvtier`).
///
/// # Panics
/// When neither exists, naming the command that builds it.
pub fn kvtier_bin() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("KVTIER_BIN") {
        return std::path::PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    let bin = exe.parent().and_then(std::path::Path::parent).expect("target/debug/deps/NAME").join("kvtier");
    assert!(bin.exists(), "{} is missing: build it first (cargo build -p kvtier-server), or set KVTIER_BIN", bin.display());
    bin
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_command_line() {
        let args = test_args(Path::new("/d"));
        assert_eq!(
            args.join(" "),
            "--listen 127.0.0.1:0 --data-dir /d --shards 2 --block-bytes 65536 --disk-gb 0.25 --segment-mib 8 \
             --pin-cpus false --io-memory-mib 128 --log-level warn --ram-gb 0"
        );
        assert_eq!(args[4..], serve_flags()[..]);
    }

    #[test]
    fn launch_args_leave_the_store_to_the_server() {
        assert_eq!(
            launch_args("127.0.0.1:7", Path::new("/d")).join(" "),
            "--listen 127.0.0.1:7 --data-dir /d --pin-cpus false --io-memory-mib 128 --log-level warn"
        );
    }

    #[test]
    fn set_flag_replaces_or_appends() {
        let mut args = test_args(Path::new("/d"));
        set_flag(&mut args, "--ram-gb", "1");
        set_flag(&mut args, "--promote", "off");
        assert_eq!(args[args.len() - 4..], ["--ram-gb", "1", "--promote", "off"]);
        assert_eq!(args.iter().filter(|a| *a == "--ram-gb").count(), 1);
    }
}
