//! The lookahead policy: how many KV slots past the scheduled tokens each allocation reserves for
//! the speculative drafter. One table, in one place.
//!
//! | method                              | lookahead |
//! |-------------------------------------|-----------|
//! | none, ngram, suffix                 | 0         |
//! | eagle, eagle3, mtp, draft_model     | K         |
//! | dflash                              | K + 1     |
//!
//! It applies to every allocation: running requests, first prefill, every prefill chunk, resume
//! after preemption, prefix-cache hits. The one exception is an admission whose KV arrives
//! asynchronously from a prefill worker (disaggregated serving): 0, so local and remote block
//! counts match; the request gets the full lookahead once it is scheduled to compute.

use crate::error::{invalid, CoreResult};

/// Speculative decoding method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecMethod {
    /// No speculative decoding.
    None,
    /// Prompt-lookup n-gram drafts (no draft KV).
    Ngram,
    /// Suffix-tree drafts (no draft KV).
    Suffix,
    /// EAGLE (autoregressive drafter over target hidden states).
    Eagle,
    /// EAGLE-3.
    Eagle3,
    /// Multi-token prediction heads.
    Mtp,
    /// A separate small draft model.
    DraftModel,
    /// DFlash: a parallel drafter writing K+1 query positions (bonus + K masks) per step.
    DFlash,
}

impl SpecMethod {
    /// Parses a method name as vLLM spells it.
    pub fn from_name(name: &str) -> CoreResult<Self> {
        Ok(match name {
            "none" => Self::None,
            "ngram" => Self::Ngram,
            "suffix" => Self::Suffix,
            "eagle" => Self::Eagle,
            "eagle3" => Self::Eagle3,
            "mtp" => Self::Mtp,
            "draft_model" => Self::DraftModel,
            "dflash" => Self::DFlash,
            other => {
                return Err(invalid!(
                    "unknown speculative method {other:?}; expected one of dflash, eagle, eagle3, \
                     mtp, draft_model, ngram, suffix"
                ))
            }
        })
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Ngram => "ngram",
            Self::Suffix => "suffix",
            Self::Eagle => "eagle",
            Self::Eagle3 => "eagle3",
            Self::Mtp => "mtp",
            Self::DraftModel => "draft_model",
            Self::DFlash => "dflash",
        }
    }

    /// Slots past the last scheduled token that the drafter writes in the same step, for K
    /// speculative tokens: the table above.
    pub fn required_lookahead(self, num_speculative_tokens: usize) -> usize {
        match self {
            Self::None | Self::Ngram | Self::Suffix => 0,
            Self::Eagle | Self::Eagle3 | Self::Mtp | Self::DraftModel => num_speculative_tokens,
            Self::DFlash => num_speculative_tokens + 1,
        }
    }
}

/// Which lookahead rule the scheduler applies. Only `Correct` is for production; the legacy
/// rules reproduce bugs that real engines shipped, so tests can prove the ownership check
/// catches them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LookaheadPolicy {
    /// The table above, on every allocation.
    #[default]
    Correct,
    /// Bug: no lookahead when a request is admitted from the waiting queue with no computed
    /// tokens (every first prefill and every resume), as vLLM <= 0.22 did.
    LegacyFirstPrefill,
    /// Bug: DFlash gets K instead of K + 1.
    LegacyK,
}

impl LookaheadPolicy {
    /// Parses `"correct"`, `"legacy-first-prefill"` or `"legacy-k"`.
    pub fn from_name(name: &str) -> CoreResult<Self> {
        Ok(match name {
            "correct" => Self::Correct,
            "legacy-first-prefill" => Self::LegacyFirstPrefill,
            "legacy-k" => Self::LegacyK,
            other => {
                return Err(invalid!(
                    "unknown lookahead_policy {other:?}; expected \"correct\", \
                     \"legacy-first-prefill\" or \"legacy-k\""
                ))
            }
        })
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Correct => "correct",
            Self::LegacyFirstPrefill => "legacy-first-prefill",
            Self::LegacyK => "legacy-k",
        }
    }
}

/// The kind of allocation being made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocationKind {
    /// A running request's next step (decode or a later prefill chunk).
    Running,
    /// Admission from the waiting queue (first prefill or resume); `num_computed_tokens` is the
    /// request's count before prefix hits (0 for fresh and preempted requests).
    Admission {
        /// Computed tokens before this admission's prefix hits.
        num_computed_tokens: usize,
    },
    /// Admission whose KV is loaded asynchronously from a remote prefill worker.
    #[cfg_attr(
        not(test),
        expect(
            dead_code,
            reason = "vLLM's rule, kept in the policy; the scheduler never loads KV"
        )
    )]
    AsyncKvLoad,
}

/// Lookahead slots for one allocation under `policy`.
pub fn lookahead_tokens(
    method: SpecMethod,
    num_speculative_tokens: usize,
    policy: LookaheadPolicy,
    kind: AllocationKind,
) -> usize {
    let required = method.required_lookahead(num_speculative_tokens);
    match (policy, kind) {
        (_, AllocationKind::AsyncKvLoad) => 0,
        (
            LookaheadPolicy::LegacyFirstPrefill,
            AllocationKind::Admission {
                num_computed_tokens: 0,
            },
        ) => 0,
        (LookaheadPolicy::LegacyK, _) if method == SpecMethod::DFlash => num_speculative_tokens,
        _ => required,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIRST_PREFILL: AllocationKind = AllocationKind::Admission {
        num_computed_tokens: 0,
    };

    #[test]
    fn table_per_method() {
        let k = 8;
        for (method, expected) in [
            (SpecMethod::None, 0),
            (SpecMethod::Ngram, 0),
            (SpecMethod::Suffix, 0),
            (SpecMethod::Eagle, k),
            (SpecMethod::Eagle3, k),
            (SpecMethod::Mtp, k),
            (SpecMethod::DraftModel, k),
            (SpecMethod::DFlash, k + 1),
        ] {
            for kind in [AllocationKind::Running, FIRST_PREFILL] {
                assert_eq!(
                    lookahead_tokens(method, k, LookaheadPolicy::Correct, kind),
                    expected
                );
            }
            assert_eq!(SpecMethod::from_name(method.name()).unwrap(), method);
        }
    }

    #[test]
    fn async_kv_load_admission_gets_none() {
        for method in [SpecMethod::DFlash, SpecMethod::Eagle, SpecMethod::Ngram] {
            let l = lookahead_tokens(
                method,
                4,
                LookaheadPolicy::Correct,
                AllocationKind::AsyncKvLoad,
            );
            assert_eq!(l, 0);
        }
    }

    #[test]
    fn legacy_policies_reproduce_the_bugs() {
        let dflash = SpecMethod::DFlash;
        let p = LookaheadPolicy::LegacyFirstPrefill;
        assert_eq!(lookahead_tokens(dflash, 3, p, FIRST_PREFILL), 0);
        assert_eq!(lookahead_tokens(dflash, 3, p, AllocationKind::Running), 4);
        let p = LookaheadPolicy::LegacyK;
        assert_eq!(lookahead_tokens(dflash, 3, p, FIRST_PREFILL), 3);
        assert_eq!(lookahead_tokens(SpecMethod::Eagle, 3, p, FIRST_PREFILL), 3);
        for name in ["correct", "legacy-first-prefill", "legacy-k"] {
            assert_eq!(LookaheadPolicy::from_name(name).unwrap().name(), name);
        }
    }
}
