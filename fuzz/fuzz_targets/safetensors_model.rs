#![no_main]
//! Fuzz target `safetensors_model`: see `kvsnap_reliability::fuzz::safetensors_model`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsnap_reliability::fuzz::safetensors_model(data));
