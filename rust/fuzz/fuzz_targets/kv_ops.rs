//! Random operation sequences on `KvCacheManager` (see `dflash_fuzz::kv`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dflash_fuzz::kv::run(data);
});
