//! Fuzz target: `eagle_check::fuzzing::pickle` (see that function for what it covers).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| eagle_check::fuzzing::pickle(data));
