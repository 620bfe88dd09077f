#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvtier_fuzz::store_ops::run(data));
