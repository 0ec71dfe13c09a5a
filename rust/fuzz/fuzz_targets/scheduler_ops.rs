//! Random operation sequences on `Scheduler` (see `dflash_fuzz::sched`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dflash_fuzz::sched::run(data);
});
