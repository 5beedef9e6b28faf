#![no_main]
//! Fuzz target `gguf`: see `kvsnap_reliability::fuzz::gguf_file`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsnap_reliability::fuzz::gguf_file(data));
