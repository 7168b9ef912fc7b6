//! Fuzz target: `eagle_check::fuzzing::config` (see that function for what it covers).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| eagle_check::fuzzing::config(data));
