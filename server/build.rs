//! Build-time switches for the GPU tier's tests (`server/tests/gpu.rs`), so
//! that a test that cannot run on this machine is reported *ignored* by the
//! test runner itself rather than passing by returning early:
//!
//! - `kvtier_real_gpu`: set when `KVTIER_GPU_TEST_DRIVER=real` at build time
//!   (`make gpu-check`); the tests then run against the machine's driver, and
//!   those that need the fake driver's fault switches are ignored.
//! - `kvtier_system_cuda`: set when the dynamic loader's cache lists a
//!   `libcuda.so.1` (an NVIDIA driver is installed); the no-driver case,
//!   which hides the driver with an empty `LD_LIBRARY_PATH`, is then ignored.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvtier_real_gpu)");
    println!("cargo::rustc-check-cfg=cfg(kvtier_system_cuda)");
    println!("cargo::rerun-if-env-changed=KVTIER_GPU_TEST_DRIVER");
    println!("cargo::rerun-if-changed=/etc/ld.so.cache");
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var("KVTIER_GPU_TEST_DRIVER").is_ok_and(|v| v == "real") {
        println!("cargo::rustc-cfg=kvtier_real_gpu");
    }
    let cache = std::process::Command::new("ldconfig").arg("-p").output();
    if cache.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim_start().starts_with("libcuda.so.1 "))) {
        println!("cargo::rustc-cfg=kvtier_system_cuda");
    }
}
