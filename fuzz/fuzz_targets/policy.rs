#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ipoib_fuzz::policy(data));
