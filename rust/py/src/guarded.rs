//! A lock around a pyclass's mutable state that makes it safe to share between Python threads.
//!
//! Calls from several threads are serialised: a thread that finds the state busy waits with the
//! GIL released, so the holder can reacquire it. The holder itself keeps the GIL: its work is
//! microseconds to a millisecond, and a released GIL that a busy thread took comes back only
//! when that thread yields it, up to the switch interval (5 ms) later. A re-entrant call from
//! the thread that already holds the state (Python code run during a call, calling back in) is
//! refused with `SchedulerStateError` instead of deadlocking. A panic inside a call becomes an
//! `InvariantError`; the object then refuses every later call, since its state may be half
//! updated. No panic reaches the interpreter and nothing aborts the process.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, TryLockError};

use pyo3::prelude::*;
use pyo3::sync::MutexExt;

use crate::errors::{py_error, ErrorClass};

static NEXT_THREAD_TOKEN: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static THREAD_TOKEN: u64 = NEXT_THREAD_TOKEN.fetch_add(1, Ordering::Relaxed);
}

/// State `T` behind a mutex, entered only through [`Guarded::with`].
pub struct Guarded<T> {
    state: Mutex<T>,
    /// Token of the thread inside `with`, 0 when none.
    holder: AtomicU64,
    /// The panic message, once a call panicked.
    failure: OnceLock<String>,
    /// What the state belongs to, for messages ("Scheduler").
    owner: &'static str,
}

impl<T> Guarded<T> {
    pub fn new(state: T, owner: &'static str) -> Self {
        Self {
            state: Mutex::new(state),
            holder: AtomicU64::new(0),
            failure: OnceLock::new(),
            owner,
        }
    }

    /// Runs `f` on the state, holding it exclusively.
    pub fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&mut T) -> PyResult<R>) -> PyResult<R> {
        let owner = self.owner;
        if let Some(msg) = self.failure.get() {
            return Err(state_error(
                py,
                format!(
                    "this {owner} stopped after an internal error and refuses further calls: {msg}"
                ),
            ));
        }
        let me = THREAD_TOKEN.with(|t| *t);
        if self.holder.load(Ordering::Acquire) == me {
            return Err(state_error(
                py,
                format!("re-entrant call: this thread is already inside a {owner} method"),
            ));
        }
        // A poisoned mutex cannot occur (panics are caught below, before the guard drops), but
        // if it ever did, the failure flag explains it; take the state as it is.
        let mut guard = self
            .state
            .lock_py_attached(py)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.holder.store(me, Ordering::Release);
        let result = catch_unwind(AssertUnwindSafe(|| f(&mut guard)));
        self.holder.store(0, Ordering::Release);
        drop(guard);
        match result {
            Ok(r) => r,
            Err(payload) => {
                let mut failure = None;
                let err = panic_to_error(py, owner, payload.as_ref(), &mut failure);
                if let Some(msg) = failure {
                    let _ = self.failure.set(msg);
                }
                Err(err)
            }
        }
    }
}

impl<T> Guarded<T> {
    /// Runs `f` on the state unless a call holds it now: never blocks and takes no GIL, for
    /// the garbage collector's `__traverse__` and `__clear__`, which must not wait (a call of
    /// this thread may hold the state while it allocates, which can start a collection).
    pub fn try_peek<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        match self.state.try_lock() {
            Ok(mut guard) => Some(f(&mut guard)),
            Err(TryLockError::Poisoned(poisoned)) => Some(f(&mut poisoned.into_inner())),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}

/// A panic caught at the boundary: the `InvariantError` to raise; records the message in
/// `failure` so that the object can refuse later calls.
pub fn panic_to_error(
    py: Python<'_>,
    owner: &str,
    payload: &(dyn Any + Send),
    failure: &mut Option<String>,
) -> PyErr {
    let msg = panic_message(payload);
    *failure = Some(msg.clone());
    py_error(
        py,
        ErrorClass::Invariant,
        format!(
            "internal error in {owner} (a bug in dflash-rs; please report it): {msg}. \
             This {owner} refuses further calls."
        ),
    )
}

/// The error for a call on an object that stopped after an internal error.
pub fn stopped_error(py: Python<'_>, owner: &str, msg: &str) -> PyErr {
    state_error(
        py,
        format!("this {owner} stopped after an internal error and refuses further calls: {msg}"),
    )
}

fn state_error(py: Python<'_>, message: String) -> PyErr {
    py_error(py, ErrorClass::SchedulerState, message)
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}
