#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvtier_fuzz::front::tenants_file(data));
