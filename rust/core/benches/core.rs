//! Criterion benchmarks of the core's hot paths, mirroring vLLM 0.33's micro-benchmarks
//! (a 256-token prompt = 16 blocks of 16, a 4,096-block pool)
//! and the Python benchmarks in `benches/python/test_bench_kv.py`.
//!
//! Run: `cargo bench -p dflash-core --bench core` (add `-- --warm-up-time 1 --measurement-time 3`
//! for a quick pass). Medians land in `target/criterion/<group>/<bench>/new/estimates.json`.
//!
//! `DFLASH_BENCH_CLOCK=cpu` measures this thread's CPU time instead of wall time (Linux). On a
//! shared, oversubscribed machine a criterion sample spans several scheduler time slices, so wall
//! time counts the slices other processes ran in; CPU time does not.

use std::hint::black_box;

use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{Criterion, Throughput};
use dflash_core::{
    pool::FreeQueue, AllocateArgs, BlockHash, BlockHasher, BlockPool, ExtraKeys, HashAlgo,
    KvCacheManager, RequestBlocks, SequenceView,
};

/// Pool size of the vLLM micro-benchmarks.
const POOL_BLOCKS: usize = 4096;
const BLOCK_SIZE: usize = 16;
const PROMPT_TOKENS: usize = 256;
const PROMPT_BLOCKS: usize = PROMPT_TOKENS / BLOCK_SIZE;
const MAX_MODEL_LEN: usize = 8192;
/// A prompt of the size vLLM's admission cost is quoted for (about 70 blocks).
const HASHED_PROMPT_TOKENS: usize = 1100;

/// Distinct token ids for prompt `index` (a small LCG: no two prompts share a block).
fn prompt(index: u64, len: usize) -> Vec<u32> {
    let mut state = index.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            3 + (state >> 33) as u32 % 31_997
        })
        .collect()
}

fn hashes_of(tokens: &[u32]) -> Vec<BlockHash> {
    let hasher = BlockHasher::new(HashAlgo::Sha256, BLOCK_SIZE, b"bench");
    let mut hashes = Vec::new();
    hasher.extend_hashes(&mut hashes, tokens, &ExtraKeys::default());
    hashes
}

fn free_queue<M: Measurement>(c: &mut Criterion<M>) {
    let mut group = c.benchmark_group("free_queue");
    group.throughput(Throughput::Elements(1));
    let mut queue = FreeQueue::new(POOL_BLOCKS, 1..POOL_BLOCKS as u32);
    group.bench_function("pop_front+push_back", |b| {
        b.iter(|| {
            let block = queue.pop_front().expect("queue is never empty");
            queue.push_back(black_box(block));
        })
    });
    group.finish();
}

fn block_pool<M: Measurement>(c: &mut Criterion<M>) {
    let mut group = c.benchmark_group("block_pool");
    for n in [1, PROMPT_BLOCKS] {
        // Caching on (as in vLLM's run), but the blocks carry no hash.
        let mut pool = BlockPool::new(POOL_BLOCKS, true).expect("valid pool");
        let mut blocks = Vec::with_capacity(n);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(format!("get_new_blocks({n})+free_blocks"), |b| {
            b.iter(|| {
                blocks.clear();
                pool.get_new_blocks(black_box(n), &mut blocks)
                    .expect("enough free blocks");
                pool.free_blocks(blocks.iter().rev().copied());
            })
        });
    }
    group.finish();
}

fn kv_manager<M: Measurement>(c: &mut Criterion<M>) {
    let mut group = c.benchmark_group("kv_manager");
    let tokens = prompt(0, PROMPT_TOKENS);
    let hashes = hashes_of(&tokens);
    let no_extra = ExtraKeys::default();
    let view = SequenceView {
        tokens: &tokens,
        block_hashes: &hashes,
        extra: &no_extra,
    };
    let whole_prompt = AllocateArgs {
        num_new_tokens: PROMPT_TOKENS,
        ..AllocateArgs::default()
    };
    group.throughput(Throughput::Elements(PROMPT_BLOCKS as u64));

    let mut mgr =
        KvCacheManager::new(POOL_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN, false).expect("valid");
    let mut req = RequestBlocks::default();
    let no_hashes = SequenceView {
        tokens: &tokens,
        block_hashes: &[],
        extra: &no_extra,
    };
    group.bench_function("allocate_slots(256)+free, caching off", |b| {
        b.iter(|| {
            let first_new = mgr.allocate_slots(&mut req, black_box(no_hashes), whole_prompt);
            black_box(first_new.expect("valid").expect("fits"));
            mgr.free(&mut req);
        })
    });

    // Caching on, the prompt cached by an earlier request: a 15-block hit + 1 new block.
    let mut mgr = KvCacheManager::new(POOL_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN, true).expect("valid");
    mgr.allocate_slots(&mut req, view, whole_prompt)
        .expect("valid")
        .expect("fits");
    mgr.free(&mut req);
    let mut hits = Vec::with_capacity(PROMPT_BLOCKS);
    group.bench_function(
        "get_computed_blocks+allocate_slots+free, full prefix hit",
        |b| {
            b.iter(|| {
                let hit_tokens = mgr.get_computed_blocks(black_box(view), &mut hits);
                let args = AllocateArgs {
                    num_new_tokens: PROMPT_TOKENS - hit_tokens,
                    num_new_computed_tokens: hit_tokens,
                    new_computed_blocks: &hits,
                    ..AllocateArgs::default()
                };
                black_box(
                    mgr.allocate_slots(&mut req, view, args)
                        .expect("valid")
                        .expect("fits"),
                );
                mgr.free(&mut req);
            })
        },
    );
    assert_eq!(
        mgr.get_computed_blocks(view, &mut hits),
        PROMPT_TOKENS - BLOCK_SIZE
    );

    // Caching on, 4x the pool's capacity of distinct prompts cycled: every lookup misses, every
    // allocation evicts 16 LRU cached blocks and caches 16 new hashes (precomputed here).
    let num_prompts = 4 * POOL_BLOCKS / PROMPT_BLOCKS;
    let prompt_tokens: Vec<Vec<u32>> = (1..=num_prompts as u64)
        .map(|i| prompt(i, PROMPT_TOKENS))
        .collect();
    let prompts: Vec<Vec<BlockHash>> = prompt_tokens.iter().map(|t| hashes_of(t)).collect();
    let mut mgr = KvCacheManager::new(POOL_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN, true).expect("valid");
    let mut next = 0;
    let mut cycle = |mgr: &mut KvCacheManager, hits: &mut Vec<u32>| {
        let view = SequenceView {
            tokens: &prompt_tokens[next],
            block_hashes: &prompts[next],
            extra: &no_extra,
        };
        next = (next + 1) % num_prompts;
        let hit_tokens = mgr.get_computed_blocks(view, hits);
        let args = AllocateArgs {
            num_new_tokens: PROMPT_TOKENS - hit_tokens,
            num_new_computed_tokens: hit_tokens,
            new_computed_blocks: hits,
            ..AllocateArgs::default()
        };
        black_box(
            mgr.allocate_slots(&mut req, view, args)
                .expect("valid")
                .expect("fits"),
        );
        mgr.free(&mut req);
        hit_tokens
    };
    for _ in 0..2 * num_prompts {
        cycle(&mut mgr, &mut hits); // fill the cache so that every later allocation evicts
    }
    group.bench_function(
        "get_computed_blocks+allocate_slots+free, miss + eviction",
        |b| b.iter(|| cycle(&mut mgr, &mut hits)),
    );
    assert_eq!(
        mgr.prefix_cache_stats().hits,
        0,
        "the miss benchmark must never hit"
    );
    group.finish();
}

fn hashing<M: Measurement>(c: &mut Criterion<M>) {
    let mut group = c.benchmark_group("hashing");
    let tokens = prompt(7, HASHED_PROMPT_TOKENS);
    let extra = ExtraKeys::default();
    group.throughput(Throughput::Elements(
        (HASHED_PROMPT_TOKENS / BLOCK_SIZE) as u64,
    ));
    for algo in [HashAlgo::Sha256, HashAlgo::Blake3, HashAlgo::Xxh3_128] {
        let hasher = BlockHasher::new(algo, BLOCK_SIZE, b"bench");
        let mut hashes = Vec::with_capacity(HASHED_PROMPT_TOKENS / BLOCK_SIZE);
        group.bench_function(format!("extend_hashes(1100 tokens) {}", algo.name()), |b| {
            b.iter(|| {
                hashes.clear();
                hasher.extend_hashes(&mut hashes, black_box(&tokens), &extra);
                black_box(&hashes);
            })
        });
    }
    group.finish();
}

fn run_all<M: Measurement>(mut c: Criterion<M>) {
    c = c.configure_from_args();
    free_queue(&mut c);
    block_pool(&mut c);
    kv_manager(&mut c);
    hashing(&mut c);
    c.final_summary();
}

fn main() {
    match std::env::var("DFLASH_BENCH_CLOCK").as_deref() {
        Ok("cpu") => run_all(Criterion::default().with_measurement(ThreadCpuTime)),
        Ok("wall") | Err(_) => run_all(Criterion::default()),
        Ok(other) => panic!("DFLASH_BENCH_CLOCK must be \"wall\" or \"cpu\", got {other:?}"),
    }
}

/// CPU time of the calling thread, in nanoseconds (`CLOCK_THREAD_CPUTIME_ID`).
struct ThreadCpuTime;

static WALL_TIME: WallTime = WallTime;

impl Measurement for ThreadCpuTime {
    type Intermediate = u64;
    type Value = u64;

    fn start(&self) -> u64 {
        thread_cpu_time_ns()
    }
    fn end(&self, start: u64) -> u64 {
        thread_cpu_time_ns() - start
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, value: &u64) -> f64 {
        *value as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        WALL_TIME.formatter() // values are nanoseconds, as wall time's
    }
}

#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn thread_cpu_time_ns() -> u64 {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    extern "C" {
        fn clock_gettime(clock_id: i32, tp: *mut Timespec) -> i32;
    }
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec (64-bit Linux layout) for the whole call.
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn thread_cpu_time_ns() -> u64 {
    panic!("DFLASH_BENCH_CLOCK=cpu needs 64-bit Linux")
}
