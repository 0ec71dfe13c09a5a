//! Test-only fault injection (cargo feature `fault-injection`).
//!
//! Named points inside the core can be armed to fail once, either with an internal error
//! ([`CoreError::Invariant`](crate::CoreError::Invariant)) or with a panic. Tests use it to
//! prove that an internal failure reaches Python as an exception and never aborts the process.
//! Without the feature every point compiles to nothing.

use crate::error::CoreResult;

/// How an armed point fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Return `CoreError::Invariant`.
    Error,
    /// Panic.
    Panic,
}

/// The points that can be armed, as `(name, what it interrupts)`.
pub const FAULT_POINTS: &[(&str, &str)] = &[
    (
        "schedule.begin",
        "Scheduler::schedule, before any state changes",
    ),
    (
        "schedule.after_running",
        "Scheduler::schedule, after the running requests were scheduled",
    ),
    (
        "update.begin",
        "Scheduler::update_from_output, before any state changes",
    ),
    (
        "allocate_slots.begin",
        "KvCacheManager::allocate_slots, before any state changes",
    ),
    (
        "add_request.begin",
        "Scheduler::add_request, before any state changes",
    ),
    (
        "preempt_all.begin",
        "Scheduler::preempt_all_running, before any state changes",
    ),
];

#[cfg(feature = "fault-injection")]
mod armed {
    use super::FaultKind;
    use crate::error::{CoreError, CoreResult};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    static ARMED: Mutex<Option<(String, FaultKind)>> = Mutex::new(None);
    /// Whether any point is armed: the fast path of `hit`, so that a dev build (which has the
    /// feature) runs its hot paths without taking a lock.
    static ANY_ARMED: AtomicBool = AtomicBool::new(false);

    fn slot() -> std::sync::MutexGuard<'static, Option<(String, FaultKind)>> {
        ARMED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn arm(point: &str, kind: FaultKind) -> CoreResult<()> {
        if !super::FAULT_POINTS.iter().any(|(name, _)| *name == point) {
            return Err(CoreError::InvalidArgument(format!(
                "unknown fault point {point:?}"
            )));
        }
        *slot() = Some((point.to_owned(), kind));
        ANY_ARMED.store(true, Ordering::Release);
        Ok(())
    }

    pub fn disarm() {
        *slot() = None;
        ANY_ARMED.store(false, Ordering::Release);
    }

    pub fn hit(point: &'static str) -> CoreResult<()> {
        if !ANY_ARMED.load(Ordering::Acquire) {
            return Ok(());
        }
        let fired = {
            let mut armed = slot();
            match armed.as_ref() {
                Some((name, kind)) if name == point => {
                    let kind = *kind;
                    *armed = None;
                    ANY_ARMED.store(false, Ordering::Release);
                    Some(kind)
                }
                _ => None,
            }
        };
        match fired {
            None => Ok(()),
            Some(FaultKind::Error) => {
                Err(CoreError::Invariant(format!("injected fault at {point}")))
            }
            Some(FaultKind::Panic) => panic!("injected panic at {point}"),
        }
    }
}

/// Arms `point` to fail once with `kind` (process-wide).
#[cfg(feature = "fault-injection")]
pub fn arm(point: &str, kind: FaultKind) -> CoreResult<()> {
    armed::arm(point, kind)
}

/// Disarms any armed point.
#[cfg(feature = "fault-injection")]
pub fn disarm() {
    armed::disarm();
}

/// A fault point: fails if armed (feature `fault-injection`), otherwise does nothing.
#[inline(always)]
pub fn hit(point: &'static str) -> CoreResult<()> {
    #[cfg(feature = "fault-injection")]
    {
        armed::hit(point)
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = point;
        Ok(())
    }
}

#[cfg(all(test, feature = "fault-injection"))]
mod tests {
    use super::*;

    #[test]
    fn armed_point_fails_once() {
        arm("update.begin", FaultKind::Error).unwrap();
        assert!(hit("schedule.begin").is_ok());
        assert!(hit("update.begin").is_err());
        assert!(hit("update.begin").is_ok());
        assert!(arm("nowhere", FaultKind::Error).is_err());
        disarm();
    }
}
