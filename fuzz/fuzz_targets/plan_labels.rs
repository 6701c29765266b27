//! The planner over arbitrary node label sets under every example policy (see fuzz/src/lib.rs).
#![no_main]
libfuzzer_sys::fuzz_target!(|case: gpu_sharing_fuzz::Labelled| {
    gpu_sharing_fuzz::plan_labels(&case);
});
