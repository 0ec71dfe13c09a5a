//! Request ids interned once per request: one Python str per slot, handed out in every step's
//! `req_ids` (one tuple shared by the steps of an unchanged batch), and found again by its
//! address when the runner hands it back.

use dflash_core::{CoreError, Scheduler};
use hashbrown::HashMap;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use pyo3::PyTraverseError;

use crate::errors::to_py;

/// The scheduler's interned request ids, by slot and by the address of their str.
pub(crate) struct InternedIds {
    /// Interned request id per slot.
    ids: Vec<Option<Py<PyString>>>,
    /// Number of `Some` entries in `ids`.
    num_interned: usize,
    /// Slot of each interned id by the address of its str, to resolve the ids the scheduler
    /// handed out without reading them. A hint only: see [`InternedIds::slot_by_identity`].
    slot_of_interned: HashMap<usize, u32>,
    /// The last step's `req_ids` tuple, handed out again while the batch is unchanged.
    last_req_ids: Option<Py<PyTuple>>,
}

impl InternedIds {
    /// No id interned yet.
    pub(crate) fn new() -> Self {
        Self {
            ids: Vec::new(),
            num_interned: 0,
            slot_of_interned: HashMap::new(),
            last_req_ids: None,
        }
    }

    /// Interns `id` as the id of the request in `slot` (replacing the slot's previous one).
    pub(crate) fn intern(&mut self, py: Python<'_>, slot: u32, id: &str) {
        let s = slot as usize;
        if self.ids.len() <= s {
            self.ids.resize_with(s + 1, || None);
        }
        let interned = PyString::new(py, id).unbind();
        let key = interned.as_ptr() as usize;
        match self.ids[s].replace(interned) {
            Some(old) => forget_interned(&mut self.slot_of_interned, &old, slot),
            None => self.num_interned += 1,
        }
        self.slot_of_interned.insert(key, slot);
    }

    /// The interned id of `slot`'s request.
    pub(crate) fn id_of(&self, py: Python<'_>, slot: u32) -> PyResult<Py<PyString>> {
        self.ids
            .get(slot as usize)
            .and_then(|x| x.as_ref())
            .map(|s| crate::refcount::new_ref(s.bind(py)).unbind())
            .ok_or_else(|| {
                to_py(
                    py,
                    CoreError::Invariant(format!("slot {slot} has no interned id")),
                )
            })
    }

    /// Drops interned ids of slots whose requests are gone from `inner` (a scan only when
    /// some are).
    pub(crate) fn forget_finished(&mut self, inner: &Scheduler) {
        if self.num_interned == inner.num_unfinished() {
            return;
        }
        self.num_interned = inner.num_unfinished();
        for (slot, id) in self.ids.iter_mut().enumerate() {
            if id.is_some() && inner.requests().get(slot as u32).is_err() {
                if let Some(gone) = id.take() {
                    forget_interned(&mut self.slot_of_interned, &gone, slot as u32);
                }
            }
        }
    }

    /// The live request (slot, generation) of `inner` that `id` names when it is the very str
    /// interned for it. Holding that str keeps its address unique, and a slot's interned id is
    /// its latest request's, so identity settles it; any other str is looked up by its text.
    pub(crate) fn slot_by_identity(
        &self,
        inner: &Scheduler,
        id: Borrowed<'_, '_, PyString>,
    ) -> Option<(u32, u32)> {
        let &slot = self.slot_of_interned.get(&(id.as_ptr() as usize))?;
        let interned = self.ids.get(slot as usize)?.as_ref()?;
        if interned.as_ptr() != id.as_ptr() {
            return None;
        }
        let generation = inner.requests().slot_of_generation(slot)?;
        Some((slot, generation))
    }

    /// The ids of `slots` (a step's batch) as a tuple: the previous step's tuple when it holds
    /// exactly these ids (a steady decode batch), so a step touches no string object; a new
    /// one otherwise. Sharing is safe because a tuple of str cannot change.
    pub(crate) fn req_ids_tuple<'py>(
        &mut self,
        py: Python<'py>,
        slots: &[u32],
    ) -> PyResult<Bound<'py, PyTuple>> {
        if let Some(prev) = &self.last_req_ids {
            let tuple = prev.bind(py);
            let unchanged = tuple.len() == slots.len()
                && slots.iter().zip(tuple.iter_borrowed()).all(|(&slot, item)| {
                    matches!(self.ids.get(slot as usize), Some(Some(id)) if item.is(id))
                });
            if unchanged {
                return Ok(tuple.clone());
            }
        }
        let ids = slots
            .iter()
            .map(|&slot| self.id_of(py, slot))
            .collect::<PyResult<Vec<_>>>()?;
        let tuple = PyTuple::new(py, ids)?;
        self.last_req_ids = Some(tuple.clone().unbind());
        Ok(tuple)
    }

    /// Garbage-collector support: visits the interned strs and the cached tuple.
    pub(crate) fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        for id in &self.ids {
            visit.call(id)?;
        }
        visit.call(&self.last_req_ids)
    }
}

/// Drops `id`'s entry of the identity map if it still names `slot` (one-character ids are
/// shared strs, so a stale slot's id may be a live request's too).
fn forget_interned(map: &mut HashMap<usize, u32>, id: &Py<PyString>, slot: u32) {
    let key = id.as_ptr() as usize;
    if map.get(&key) == Some(&slot) {
        map.remove(&key);
    }
}
