//! Which vLLM release series the scheduler follows where their schedulers differ.

use crate::error::{invalid, CoreResult};

/// The vLLM scheduler whose behaviour the core reproduces step by step (the vLLM drop-in sets
/// the installed one). The two differ in:
///
/// - when a running request's blocks are registered in the prefix cache: 0.33 registers the
///   blocks its accepted tokens filled as each output is applied (with speculative decoding or
///   output placeholders); 0.32 only under async scheduling, and otherwise at the next
///   allocation;
/// - a stop: 0.33 takes back the computed-token claim of the tokens cut after a stop, 0.32
///   keeps it; and the placeholders a stopping request resolves (all it sampled, or the kept);
/// - priority preemption: a running request that preempts itself lets the requests after it be
///   tried in 0.33, and ends the running phase in 0.32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VllmSemantics {
    /// vLLM 0.32.
    V0_32,
    /// vLLM 0.33 (the default).
    #[default]
    V0_33,
}

impl VllmSemantics {
    /// Parses "0.32" or "0.33".
    pub fn from_name(name: &str) -> CoreResult<Self> {
        match name {
            "0.32" => Ok(Self::V0_32),
            "0.33" => Ok(Self::V0_33),
            other => Err(invalid!(
                "unknown vLLM semantics {other:?}; expected \"0.32\" or \"0.33\""
            )),
        }
    }

    /// The release series' name.
    pub fn name(self) -> &'static str {
        match self {
            Self::V0_32 => "0.32",
            Self::V0_33 => "0.33",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::VllmSemantics;

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for s in [VllmSemantics::V0_32, VllmSemantics::V0_33] {
            assert_eq!(VllmSemantics::from_name(s.name()).unwrap(), s);
        }
        assert!(VllmSemantics::from_name("0.34").is_err());
        assert_eq!(VllmSemantics::default(), VllmSemantics::V0_33);
    }
}
