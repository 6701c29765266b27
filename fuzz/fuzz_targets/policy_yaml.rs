//! Arbitrary bytes as a policy file: read, validated, rendered (see fuzz/src/lib.rs).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gpu_sharing_fuzz::policy_yaml(data);
});
