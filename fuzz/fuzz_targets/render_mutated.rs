//! The examples with arbitrary edits, rendered with and without nodes (see fuzz/src/lib.rs).
#![no_main]
libfuzzer_sys::fuzz_target!(|case: gpu_sharing_fuzz::Mutated| {
    gpu_sharing_fuzz::render_mutated(&case);
});
