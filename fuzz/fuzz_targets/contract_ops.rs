#![no_main]
//! Fuzz target `contract_ops`: see `kvsnap_reliability::fuzz::contract_ops`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvsnap_reliability::fuzz::contract_ops(data));
