#![no_main]
//! Fuzz target `config_json`: see `kvsnap_reliability::fuzz::config_json`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsnap_reliability::fuzz::config_json(data));
