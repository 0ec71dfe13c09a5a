//! Chained block hashes for the prefix cache.
//!
//! `hash_i = H(hash_{i-1} || tokens_i || extra_i)`, with `hash_{-1}` the hasher's root (derived from
//! a seed). The byte encoding is length-prefixed and tagged so that no two different inputs share
//! bytes. Extra keys: the LoRA name (every block), the cache salt (first block only) and, for a
//! prompt given as embeddings, a digest of each block's embeddings, so tenants with different
//! salts or adapters, and prompts with different embeddings, never share a block.

mod sha256;

use sha2::{Digest, Sha256};

use crate::error::{invalid, CoreResult};

/// Width of a block hash in bytes. SHA-256 and BLAKE3 fill all of it; XXH3-128 fills the first 16.
pub const HASH_BYTES: usize = 32;

/// A block's chained hash.
pub type BlockHash = [u8; HASH_BYTES];

/// Hash function behind the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlgo {
    /// SHA-256 (default): cryptographic, safe when tenants share the prefix cache.
    Sha256,
    /// BLAKE3 keyed with the hasher's root: cryptographic, keyed by a secret root. Faster than
    /// SHA-256 on CPUs without SHA extensions; slower on ~100-byte blocks where SHA-NI exists.
    Blake3,
    /// XXH3-128: fast, not cryptographic. Only for single-tenant deployments.
    Xxh3_128,
    /// Test-only (feature `fault-injection`): every block hashes to the same value, a forced
    /// collision of every key, to show that verified hits never share KV across prefixes.
    #[cfg(feature = "fault-injection")]
    TestCollide,
}

impl HashAlgo {
    /// Parses a name as the Python API spells it.
    pub fn from_name(name: &str) -> CoreResult<Self> {
        match name {
            "sha256" => Ok(Self::Sha256),
            "blake3" => Ok(Self::Blake3),
            "xxh3_128" | "xxhash" => Ok(Self::Xxh3_128),
            #[cfg(feature = "fault-injection")]
            "test-collide" => Ok(Self::TestCollide),
            other => Err(invalid!(
                "unknown hash_algo {other:?}; expected one of \"sha256\", \"blake3\", \"xxh3_128\""
            )),
        }
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Blake3 => "blake3",
            Self::Xxh3_128 => "xxh3_128",
            #[cfg(feature = "fault-injection")]
            Self::TestCollide => "test-collide",
        }
    }
}

/// Extra keys mixed into block hashes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    /// LoRA adapter name; part of every block's hash.
    pub lora_name: Option<String>,
    /// Per-tenant cache salt; part of the first block's hash (and so of every later one).
    pub cache_salt: Option<String>,
    /// A prompt given as embeddings (its tokens are placeholders): a digest of block `i`'s
    /// embedding rows, part of block `i`'s hash (vLLM's per-block `prompt_embeds` key). Empty
    /// for token prompts.
    pub prompt_embed_hashes: Vec<BlockHash>,
}

impl ExtraKeys {
    /// The key of block `index` beyond the LoRA name and salt (a prompt-embedding digest).
    #[inline]
    pub fn block_key(&self, index: usize) -> Option<&BlockHash> {
        self.prompt_embed_hashes.get(index)
    }
}

const TAG_LORA: u8 = 1;
const TAG_SALT: u8 = 2;
const TAG_EMBEDS: u8 = 3;
/// The tokens after a block that its hash also covers (see [`BlockHasher::with_lookahead`]).
const TAG_LOOKAHEAD: u8 = 4;

/// Computes chained block hashes with one algorithm and root.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    algo: HashAlgo,
    root: BlockHash,
    block_size: usize,
    lookahead: usize,
}

impl BlockHasher {
    /// A hasher whose root is derived from `seed` (equal seeds give equal hashes).
    pub fn new(algo: HashAlgo, block_size: usize, seed: &[u8]) -> Self {
        let mut root = [0u8; HASH_BYTES];
        root.copy_from_slice(&Sha256::digest(
            [b"dflash-rs/root/v1:".as_slice(), seed].concat(),
        ));
        Self {
            algo,
            root,
            block_size,
            lookahead: 0,
        }
    }

    /// This hasher with each block's hash also covering the `tokens` after the block (vLLM
    /// 0.33's lookahead block hashes for EAGLE-style drafters, whose KV at a block's last
    /// position depends on the next token). A block is hashed only once those tokens exist.
    pub fn with_lookahead(mut self, tokens: usize) -> Self {
        self.lookahead = tokens;
        self
    }

    /// Tokens after each block that its hash covers (0: the block alone).
    pub fn lookahead(&self) -> usize {
        self.lookahead
    }

    /// Blocks of a `num_tokens`-token sequence that can be hashed: full blocks followed by
    /// [`Self::lookahead`] tokens.
    pub fn num_hashable_blocks(&self, num_tokens: usize) -> usize {
        num_tokens.saturating_sub(self.lookahead) / self.block_size
    }

    /// Whether growing a sequence from `before` to `after` tokens makes more of its blocks
    /// hashable (`num_hashable_blocks(after) > num_hashable_blocks(before)`, with one division).
    pub fn hashes_more(&self, before: usize, after: usize) -> bool {
        let (a, b) = (
            before.saturating_sub(self.lookahead),
            after.saturating_sub(self.lookahead),
        );
        // The next hashable block ends at a - a % block_size + block_size.
        b.saturating_sub(a) >= self.block_size - a % self.block_size
    }

    /// The algorithm in use.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// Tokens per hashed block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Hash of full block `index` given its parent's hash (None for the first block) and
    /// the [`Self::lookahead`] tokens after it (empty without lookahead).
    pub fn hash_block(
        &self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        lookahead: &[u32],
        extra: &ExtraKeys,
        index: usize,
    ) -> BlockHash {
        let parent = parent.unwrap_or(&self.root);
        if let Some(h) = self.hash_plain_block(parent, tokens, lookahead, extra, index) {
            return h;
        }
        let salt = if index == 0 {
            extra.cache_salt.as_deref()
        } else {
            None
        };
        let mut lookahead_stack = [0u8; 4 * 16];
        let mut lookahead_heap = Vec::new();
        let lookahead_bytes = if lookahead.is_empty() {
            None
        } else {
            let buf: &mut [u8] = if 4 * lookahead.len() <= lookahead_stack.len() {
                &mut lookahead_stack[..4 * lookahead.len()]
            } else {
                lookahead_heap.resize(4 * lookahead.len(), 0);
                &mut lookahead_heap
            };
            for (dst, t) in buf.chunks_exact_mut(4).zip(lookahead) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            Some(&*buf)
        };
        let extras = [
            (TAG_LORA, extra.lora_name.as_deref().map(str::as_bytes)),
            (TAG_SALT, salt.map(str::as_bytes)),
            (TAG_LOOKAHEAD, lookahead_bytes),
            (TAG_EMBEDS, extra.block_key(index).map(|k| k.as_slice())),
        ];
        if self.algo == HashAlgo::Sha256 {
            // The usual block (about 100 bytes) is encoded straight into a padded SHA-256
            // message.
            let len = encoded_len(tokens, &extras);
            if len <= sha256::MAX_INLINE {
                let mut msg = sha256::PaddedMessage::new(len);
                encode(msg.message_mut(), parent, tokens, &extras);
                return msg.digest();
            }
        }
        // One call over the whole encoding: the hashes' streaming states cost more than the
        // hashing itself for a ~100-byte block.
        with_encoding(parent, tokens, &extras, |bytes| match self.algo {
            HashAlgo::Sha256 => sha256::digest(bytes),
            HashAlgo::Blake3 => *blake3::keyed_hash(&self.root, bytes).as_bytes(),
            HashAlgo::Xxh3_128 => {
                let mut out = [0u8; HASH_BYTES];
                out[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(bytes).to_le_bytes());
                out
            }
            #[cfg(feature = "fault-injection")]
            HashAlgo::TestCollide => [0x5a; HASH_BYTES],
        })
    }

    /// The SHA-256 hash of a block without extra keys (no LoRA name, salt, lookahead or
    /// embedding digest: the usual block), encoded straight into a padded message; None for
    /// any other block, which [`Self::hash_block`] encodes with its keys. The bytes are those
    /// of [`encode`] without extra keys.
    #[inline]
    fn hash_plain_block(
        &self,
        parent: &BlockHash,
        tokens: &[u32],
        lookahead: &[u32],
        extra: &ExtraKeys,
        index: usize,
    ) -> Option<BlockHash> {
        let len = HASH_BYTES + 4 + 4 * tokens.len();
        let plain = self.algo == HashAlgo::Sha256
            && lookahead.is_empty()
            && extra.lora_name.is_none()
            && (index > 0 || extra.cache_salt.is_none())
            && extra.block_key(index).is_none()
            && len <= sha256::MAX_INLINE;
        if !plain {
            return None;
        }
        let mut msg = sha256::PaddedMessage::new(len);
        let buf = msg.message_mut();
        buf[..HASH_BYTES].copy_from_slice(parent);
        buf[HASH_BYTES..HASH_BYTES + 4].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
        for (dst, t) in buf[HASH_BYTES + 4..].chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        Some(msg.digest())
    }

    /// Appends the hashes of every hashable block of `tokens` (see
    /// [`Self::num_hashable_blocks`]) not yet in `hashes`.
    pub fn extend_hashes(&self, hashes: &mut Vec<BlockHash>, tokens: &[u32], extra: &ExtraKeys) {
        let num_full = self.num_hashable_blocks(tokens.len());
        hashes.reserve(num_full.saturating_sub(hashes.len()));
        for i in hashes.len()..num_full {
            let end = (i + 1) * self.block_size;
            let block = &tokens[i * self.block_size..end];
            let lookahead = &tokens[end..end + self.lookahead];
            let parent = if i == 0 { None } else { Some(&hashes[i - 1]) };
            // The usual block without a call; any other through `hash_block`.
            let plain =
                self.hash_plain_block(parent.unwrap_or(&self.root), block, lookahead, extra, i);
            let h = match plain {
                Some(h) => h,
                None => self.hash_block(parent, block, lookahead, extra, i),
            };
            hashes.push(h);
        }
    }
}

/// Bytes a block's encoding keeps on the stack: parent, count and 64 tokens, with room for
/// short extra keys (longer blocks or keys go through the heap).
const INLINE_BLOCK_BYTES: usize = 384;

/// The extra keys a block's encoding carries, with their tags.
type TaggedExtras<'a> = [(u8, Option<&'a [u8]>); 4];

/// Length of a block's canonical encoding.
fn encoded_len(tokens: &[u32], extras: &TaggedExtras<'_>) -> usize {
    let extra_len: usize = extras
        .iter()
        .filter_map(|(_, v)| v.map(|v| 5 + v.len()))
        .sum();
    HASH_BYTES + 4 + 4 * tokens.len() + extra_len
}

/// Writes the canonical encoding of one block into `buf` (exactly [`encoded_len`] bytes):
/// parent, token count and tokens (u32 little endian), then tagged, length-prefixed extra keys.
fn encode(buf: &mut [u8], parent: &BlockHash, tokens: &[u32], extras: &TaggedExtras<'_>) {
    buf[..HASH_BYTES].copy_from_slice(parent);
    buf[HASH_BYTES..HASH_BYTES + 4].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
    let token_bytes = &mut buf[HASH_BYTES + 4..HASH_BYTES + 4 + 4 * tokens.len()];
    for (dst, t) in token_bytes.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    let mut at = HASH_BYTES + 4 + 4 * tokens.len();
    for (tag, value) in extras {
        if let Some(v) = value {
            buf[at] = *tag;
            buf[at + 1..at + 5].copy_from_slice(&(v.len() as u32).to_le_bytes());
            buf[at + 5..at + 5 + v.len()].copy_from_slice(v);
            at += 5 + v.len();
        }
    }
}

/// Calls `hash` on the canonical encoding of one block (see [`encode`]).
fn with_encoding<R>(
    parent: &BlockHash,
    tokens: &[u32],
    extras: &TaggedExtras<'_>,
    hash: impl FnOnce(&[u8]) -> R,
) -> R {
    let len = encoded_len(tokens, extras);
    let mut stack = [0u8; INLINE_BLOCK_BYTES];
    let mut heap = Vec::new();
    let buf: &mut [u8] = if len <= INLINE_BLOCK_BYTES {
        &mut stack[..len]
    } else {
        heap.resize(len, 0);
        &mut heap
    };
    encode(buf, parent, tokens, extras);
    hash(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher(algo: HashAlgo) -> BlockHasher {
        BlockHasher::new(algo, 4, b"test")
    }

    #[test]
    fn chain_depends_on_every_earlier_token() {
        for algo in [HashAlgo::Sha256, HashAlgo::Blake3, HashAlgo::Xxh3_128] {
            let h = hasher(algo);
            let extra = ExtraKeys::default();
            let mut a = Vec::new();
            h.extend_hashes(&mut a, &[1, 2, 3, 4, 5, 6, 7, 8, 9], &extra);
            assert_eq!(a.len(), 2, "only full blocks are hashed");
            let mut b = Vec::new();
            h.extend_hashes(&mut b, &[0, 2, 3, 4, 5, 6, 7, 8], &extra);
            assert_ne!(a[0], b[0]);
            assert_ne!(a[1], b[1], "second block differs through the chain");
        }
    }

    #[test]
    fn incremental_equals_batch() {
        let h = hasher(HashAlgo::Sha256);
        let extra = ExtraKeys {
            lora_name: Some("l".into()),
            cache_salt: Some("s".into()),
            ..Default::default()
        };
        let tokens: Vec<u32> = (0..23).collect();
        let mut batch = Vec::new();
        h.extend_hashes(&mut batch, &tokens, &extra);
        let mut inc = Vec::new();
        for n in 0..=tokens.len() {
            h.extend_hashes(&mut inc, &tokens[..n], &extra);
        }
        assert_eq!(batch, inc);
    }

    #[test]
    fn salt_and_lora_separate_tenants() {
        let h = hasher(HashAlgo::Sha256);
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        let base = ExtraKeys::default();
        let salted = ExtraKeys {
            cache_salt: Some("a".into()),
            ..Default::default()
        };
        let salted_b = ExtraKeys {
            cache_salt: Some("b".into()),
            ..Default::default()
        };
        let lora = ExtraKeys {
            lora_name: Some("a".into()),
            ..Default::default()
        };
        let mut all = Vec::new();
        for extra in [&base, &salted, &salted_b, &lora] {
            let mut v = Vec::new();
            h.extend_hashes(&mut v, &tokens, extra);
            all.push(v);
        }
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert_ne!(all[i][0], all[j][0]);
                assert_ne!(all[i][1], all[j][1]);
            }
        }
    }

    /// Placeholder tokens with different embedding digests never share a block; equal digests
    /// share the prefix they agree on.
    #[test]
    fn prompt_embed_digests_key_their_blocks() {
        let h = hasher(HashAlgo::Sha256);
        let tokens = [0u32; 12];
        let embeds = |digests: &[u8]| ExtraKeys {
            prompt_embed_hashes: digests.iter().map(|&d| [d; HASH_BYTES]).collect(),
            ..Default::default()
        };
        let hashes = |extra: &ExtraKeys| {
            let mut v = Vec::new();
            h.extend_hashes(&mut v, &tokens, extra);
            v
        };
        let (a, b, plain) = (
            hashes(&embeds(&[1, 2])),
            hashes(&embeds(&[1, 3])),
            hashes(&ExtraKeys::default()),
        );
        assert_eq!(a[0], b[0], "same first-block embeddings");
        assert_ne!(a[1], b[1]);
        assert_ne!(a[0], plain[0]);
        // Past the prompt's blocks the chain alone keys the block.
        assert_ne!(a[2], plain[2]);
        assert_ne!(a[2], b[2]);
    }

    /// A block without extra keys hashes (through `hash_plain_block`) to the SHA-256 of its
    /// canonical encoding without extra keys, as every other block does with its keys.
    #[test]
    fn plain_blocks_hash_their_encoding() {
        let h = BlockHasher::new(HashAlgo::Sha256, 16, b"plain");
        let tokens: Vec<u32> = (0..48).map(|i| i * 7919 + 3).collect();
        let salted = ExtraKeys {
            cache_salt: Some("s".into()),
            ..Default::default()
        };
        for extra in [ExtraKeys::default(), salted] {
            let mut hashes = Vec::new();
            h.extend_hashes(&mut hashes, &tokens, &extra);
            for (i, got) in hashes.iter().enumerate() {
                let parent = if i == 0 { &h.root } else { &hashes[i - 1] };
                let block = &tokens[16 * i..16 * (i + 1)];
                let salt = extra.cache_salt.as_deref().filter(|_| i == 0);
                let extras: TaggedExtras<'_> = [
                    (TAG_LORA, None),
                    (TAG_SALT, salt.map(str::as_bytes)),
                    (TAG_LOOKAHEAD, None),
                    (TAG_EMBEDS, None),
                ];
                let want = with_encoding(parent, block, &extras, |b| {
                    <[u8; 32]>::from(Sha256::digest(b))
                });
                assert_eq!(*got, want, "block {i}");
            }
        }
    }

    #[test]
    fn hashes_more_counts_hashable_blocks() {
        for (bs, lookahead) in [(1, 0), (4, 0), (4, 1), (16, 3)] {
            let h = BlockHasher::new(HashAlgo::Sha256, bs, b"").with_lookahead(lookahead);
            for before in 0..40 {
                for after in 0..40 {
                    assert_eq!(
                        h.hashes_more(before, after),
                        h.num_hashable_blocks(after) > h.num_hashable_blocks(before),
                        "block size {bs}, lookahead {lookahead}: {before} -> {after}"
                    );
                }
            }
        }
    }

    #[test]
    fn seed_changes_root() {
        let a = BlockHasher::new(HashAlgo::Sha256, 2, b"x");
        let b = BlockHasher::new(HashAlgo::Sha256, 2, b"y");
        let e = ExtraKeys::default();
        assert_ne!(
            a.hash_block(None, &[1, 2], &[], &e, 0),
            b.hash_block(None, &[1, 2], &[], &e, 0)
        );
    }

    /// With lookahead, a block is hashed once the tokens after it exist, and its hash covers
    /// them: sequences that differ only in the token after a block differ in that block's hash.
    #[test]
    fn lookahead_hashes_cover_the_next_tokens() {
        let extra = ExtraKeys::default();
        for lookahead in [1, 2, 17] {
            let h = hasher(HashAlgo::Sha256).with_lookahead(lookahead);
            let plain = hasher(HashAlgo::Sha256);
            let tokens: Vec<u32> = (0..40).collect();
            for n in 0..=tokens.len() {
                let mut v = Vec::new();
                h.extend_hashes(&mut v, &tokens[..n], &extra);
                assert_eq!(v.len(), n.saturating_sub(lookahead) / 4, "n={n}");
            }
            let mut a = Vec::new();
            h.extend_hashes(&mut a, &tokens, &extra);
            let mut changed = tokens.clone();
            changed[4 + lookahead - 1] += 100; // in block 0's lookahead (and block 1 or later)
            let mut b = Vec::new();
            h.extend_hashes(&mut b, &changed, &extra);
            assert_ne!(a[0], b[0], "lookahead {lookahead}");
            let mut legacy = Vec::new();
            plain.extend_hashes(&mut legacy, &tokens, &extra);
            assert_ne!(a[0], legacy[0], "lookahead hashes are not the legacy ones");
            let mut inc = Vec::new();
            for n in 0..=tokens.len() {
                h.extend_hashes(&mut inc, &tokens[..n], &extra);
            }
            assert_eq!(a, inc, "incremental equals batch");
        }
    }

    #[test]
    fn algo_names_round_trip() {
        for algo in [HashAlgo::Sha256, HashAlgo::Blake3, HashAlgo::Xxh3_128] {
            assert_eq!(HashAlgo::from_name(algo.name()).unwrap(), algo);
        }
        assert!(HashAlgo::from_name("md5").is_err());
    }
    /// The byte encoding (and so every hash) is fixed: hashes of the same prefix must agree
    /// across versions of this crate, e.g. for engines that publish them as KV events.
    #[test]
    fn hashes_are_stable() {
        let extra = ExtraKeys {
            lora_name: Some("lora".into()),
            cache_salt: Some("salt".into()),
            ..Default::default()
        };
        let tokens: Vec<u32> = (0..40).map(|i| i * 7919 + 3).collect();
        for algo in [HashAlgo::Sha256, HashAlgo::Blake3, HashAlgo::Xxh3_128] {
            let h = BlockHasher::new(algo, 16, b"stable");
            let mut v = Vec::new();
            h.extend_hashes(&mut v, &tokens, &extra);
            let hex: Vec<String> = v
                .iter()
                .map(|b| b.iter().map(|x| format!("{x:02x}")).collect())
                .collect();
            let expected: &[&str] = match algo {
                HashAlgo::Sha256 => &[
                    "a1ac949fde6debc54f6e54e6001034289564bee82cb29ffea90452e55e26da6c",
                    "c817054df4d1ede8104959ed4b2dddad3ebd4c26d0dc6088b04bb47951066b3d",
                ],
                HashAlgo::Blake3 => &[
                    "698de495bc999db8e2e7b61b0972ac10d988d99b85a42e2207a6161f4b3ee047",
                    "64118e466e1c4ea2d92d9016359fc8cedac3848cc65d9c13256248fd567f98e5",
                ],
                _ => &[
                    "0a7cfe0728d7b1e5aee88a164d75db0700000000000000000000000000000000",
                    "185a19444d28a80fc19bd7544a34683c00000000000000000000000000000000",
                ],
            };
            assert_eq!(hex, expected, "{}", algo.name());
        }
    }
}
